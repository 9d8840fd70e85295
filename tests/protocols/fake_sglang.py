"""A fake SGLang server for the `sglang` weight protocol: the documented request schemas (SGLang 0.5.x io_struct)
as strict pydantic models, a pause state machine, and a real gloo weight group joined the way SGLang's workers
join it (`join_like_sglang`, step for step SGLang's own code), receiving one broadcast per announced tensor."""

from __future__ import annotations

import datetime
import time
from typing import Literal

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitWeightsUpdateGroup(Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributed(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroup(Strict):
    group_name: str = "weight_update_group"


class PauseGeneration(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGeneration(Strict):
    torch_empty_cache: bool = True


def join_like_sglang(init_method: str, rank: int, world_size: int, group_name: str, backend: str,
                     timeout: datetime.timedelta):
    """SGLang 0.5.x's `init_custom_process_group` (python/sglang/srt/utils/common.py; checked against the 0.5.x
    sources of sgl-project/sglang), as `ModelRunner.init_weights_update_group` (python/sglang/srt/model_executor/
    model_runner.py) calls it with `init_method="tcp://{master_address}:{master_port}"`: torch's rendezvous gives a
    TCPStore client; the store is wrapped in `PrefixStore(group_name, store)`; `_new_process_group_helper` (which
    adds `<group_name>/` and `<device>/` itself) builds the group; the group is registered in `_world`."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)  # the layer a client without it never meets: it waits until the timeout
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def fail(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=400)


class FakeSGLang:
    def __init__(self, tp_size: int = 1):
        self.tp_size = tp_size
        self.calls: list[tuple[str, dict]] = []
        self.received: list[list[tuple[str, torch.Tensor]]] = []  # one list per update
        self.paused: str | None = None
        self.groups: dict[str, object] = {}
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/get_server_info")
        def info():
            return {"tp_size": self.tp_size, "pp_size": 1}

        @app.post("/init_weights_update_group")
        def init(req: InitWeightsUpdateGroup):
            self.calls.append(("init", req.model_dump()))
            if req.group_name in self.groups:
                return fail(f"group {req.group_name} already exists")
            if req.backend != "gloo":
                return fail(f"this fake joins gloo groups only, not {req.backend}")
            # tp rank 0 of the server: rank = rank_offset + tp_rank (ModelRunner.init_weights_update_group)
            self.groups[req.group_name] = join_like_sglang(f"tcp://{req.master_address}:{req.master_port}",
                                                           req.rank_offset, req.world_size, req.group_name,
                                                           req.backend, datetime.timedelta(seconds=30))
            return {"success": True, "message": "joined"}

        @app.post("/destroy_weights_update_group")
        def destroy(req: DestroyWeightsUpdateGroup):
            self.calls.append(("destroy", req.model_dump()))
            pg = self.groups.pop(req.group_name, None)
            if pg is None:
                return fail(f"no weight update group {req.group_name!r}")
            torch.distributed.destroy_process_group(pg)  # also unregisters the name: a later client may rejoin
            return {"success": True, "message": "destroyed"}

        @app.get("/_state")  # test-only: what this fake saw and received (tensors as float64 lists)
        def state():
            return {"calls": self.calls, "paused": self.paused, "received": [
                [{"name": n, "dtype": str(t.dtype).split(".")[-1], "values": t.double().flatten().tolist()}
                 for n, t in upd] for upd in self.received]}

        @app.post("/_set_paused")  # test-only: simulate a server someone else paused
        def set_paused(req: PauseGeneration):
            self.paused = req.mode
            return {"success": True}

        @app.post("/pause_generation")
        def pause(req: PauseGeneration):
            self.calls.append(("pause", req.model_dump()))
            if self.paused:
                return fail("already paused")
            self.paused = req.mode
            return {"success": True, "message": "paused"}

        @app.post("/continue_generation")
        def cont(req: ContinueGeneration):
            self.calls.append(("continue", req.model_dump()))
            if not self.paused:
                return fail("not paused")
            self.paused = None
            return {"success": True, "message": "continued"}

        @app.post("/update_weights_from_distributed")
        def update(req: UpdateWeightsFromDistributed):
            self.calls.append(("update", req.model_dump()))
            pg = self.groups.get(req.group_name)
            if pg is None:
                return fail(f"no weight update group {req.group_name!r} (call /init_weights_update_group first)")
            if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
                return fail("names, dtypes and shapes differ in length")
            if self.paused == "in_place" and req.flush_cache:
                return fail("cannot flush the cache while requests are paused in place")
            got = []
            for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                pg.broadcast([t], opts).wait()
                got.append((name, t))
            self.received.append(got)
            return {"success": True, "message": "updated"}

        return app


def main() -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    uvicorn.run(FakeSGLang().app, host="127.0.0.1", port=args.port, log_level="warning")


class FakeProcess:
    """One fake per process (each joins torch's global group registry under SGLang's group name): `.url`, `.stop()`,
    `.state()`."""

    def __init__(self, module: str = "tests.protocols.fake_sglang"):
        import os
        import subprocess
        import sys
        from pathlib import Path

        import httpx

        from inflight.process import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        root = str(Path(__file__).resolve().parents[2])
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port)], cwd=root,
                                     env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/_state", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("fake server did not start")
            time.sleep(0.1)

    def state(self) -> dict:
        import httpx

        return httpx.get(self.url + "/_state", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    main()
