"""`trainer.protocol: inflight`: the trainer side of inflight's weight-update contract (docs/inference-contract.md),
spoken by the built-in engine and by `inflight serve --engine vllm`: rank 0 hosts the TCPStore, asks every
server to join the process group, and after each optimizer step announces the tensors and broadcasts them.

    client = WeightSyncClient(["http://127.0.0.1:8100"])
    client.init_process_group()
    stats = client.push(trainer.named_weights(), version=trainer.version)

Tensors are converted to the servers' dtype and broadcast in the announced order. With `bucket_bytes` > 0 the
small ones travel packed in flat buffers of up to that size (`contracts.bucket_layout`), one broadcast per bucket;
a tensor that fills a bucket alone is sent as it is, never copied (measured 2026-11-29 on 2 shared cores: 100 MiB
in 74 float32 tensors took 0.11-0.17 s as one gloo broadcast per tensor, 0.22-0.27 s flattened into one buffer;
measured 2026-12-02: the tiny model's ~30 small tensors in buckets cut its push to a generating server from 0.040
to 0.026 s median). `transport="file"` writes one safetensors file under /dev/shm instead
and posts its path (single host only). `transport="shm"` (single host) writes the tensors once into a shared-memory
segment (inflight/transport/shm.py) that every server on the host copies from: two memory copies in all, which
overlap (the servers are asked first and copy each tensor as soon as it is written).

A trainer that makes the tensors fresh for each push (FSDP2 gathers them) calls `prepare()` first: the update is
converted and packed as it is gathered (prepared.py), held once in the wire dtype, and `push()` takes it as often as
a retry needs.

A tensor registered under several names (tied embeddings) is sent once, under its first name (the contract's
canonical one). On a CUDA trainer (`device`) the helper threads that create and drive the NCCL communicator make
that device current first: a new thread starts on device 0 whatever the trainer uses.

A server that dies during the broadcasts must not hold the others there until the group timeout: the broadcasts run
on their own thread while the servers' answers are watched, and on the first failure (a broadcast error or a
server's request failing) the trainer drops its end of the group (`abort_group`). Closing its gloo connections makes
every server still receiving fail at once; a server drops what it received (nothing applied) and answers 409, and
the next push needs `init_process_group()` again.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Any, Iterable

import torch
from safetensors.torch import save_file
from torch.distributed import ProcessGroupGloo, TCPStore

from inflight.config import RunConfig
from inflight.transport.schemas import MAX_GROUP_TIMEOUT_S, AdapterSpec, ParamInfo, adapter_pairs
from inflight.transport.layout import bucket_layout, packed_bytes, shm_layout
from inflight.process import free_port
from inflight.transport.shm import ShmError, ShmWriter, announcement_digest, progress_is_ordered
from inflight.transport.cuda_ipc import IpcWriter  # transport cuda_ipc (same device): inflight/trainer/weight_sync/ipc_push.py
from inflight.trainer.weight_sync.ipc_push import push_ipc
from inflight.trainer.weight_sync.prepared import PreparedUpdate, prepare_update
from inflight.trainer.weight_sync.common import (DTYPE_NAMES, ProtocolClient, ServerAnswered, WeightSyncError,
                                               on_device, release_group, run_into, unique_tensors)

log = logging.getLogger("inflight.trainer.weight_sync.inflight")

TRANSPORTS = ("process_group", "file", "shm", "cuda_ipc")
SENDER_GRACE_S = 1.0  # after a server answered an error, how long the broadcast may take to finish before the abort
ABORT_ANSWER_S = 30.0  # after an abort, how long the servers get to answer (they leave the broadcast at once)


def _params(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> list[dict]:
    """The announcement of `tensors` as sent in `dtype` (None: their own)."""
    return [{"name": n, "shape": list(t.shape), "dtype": DTYPE_NAMES[dtype or t.dtype]} for n, t in tensors]


class WeightSyncClient(ProtocolClient):
    """inflight's contract on ProtocolClient's HTTP plumbing: transports process_group (gloo or NCCL, optionally in
    buckets), shm and file; a dry run before an announcement the servers have not taken yet; abort on a failure."""

    protocol = "inflight"

    def __init__(self, server_urls: list[str], *, api_key: str | None = None, master_address: str = "127.0.0.1",
                 master_port: int = 0, backend: str = "gloo", transport: str = "process_group",
                 timeout_s: float = 600.0, dtype: str | None = None, shm_dir: str = "/dev/shm",
                 precheck: bool = True, bucket_bytes: int = 0, device: str | torch.device | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        super().__init__(server_urls, api_key=api_key, master_address=master_address, master_port=master_port,
                         backend=backend, timeout_s=timeout_s, dtype=dtype, device=device)
        self.transport = transport
        self.group: Any = None  # a torch ProcessGroup (gloo or NCCL) of our own, not a Broadcaster
        self.shm_dir = shm_dir if os.path.isdir(shm_dir) else tempfile.gettempdir()
        self.precheck = precheck
        self.bucket_bytes = bucket_bytes
        self._shm = ShmWriter(self.shm_dir) if transport == "shm" else None
        self._ipc = IpcWriter(self.device, self.shm_dir) if transport == "cuda_ipc" else None
        self._shm_layout: tuple | None = None  # (announcement, offsets, data bytes, digest) of the last shm push
        self.last_write_s = 0.0  # seconds the last shm push took to write its segment
        self._layout: tuple | None = None  # ((announcement, bucket_bytes), buckets, packed sizes) of the last push
        self._buckets: list[torch.Tensor] = []  # its packing buffers, reused while the announcement stays the same
        self._generation = 0  # +1 whenever the group is replaced or aborted: a stale abort leaves a new group alone
        self._group_thread: threading.Thread | None = None
        self._releases: list[threading.Thread] = []  # groups being shut down and freed (release_group)
        # until one push is answered, pushes say new_run: the servers may hold a later version (of an earlier run,
        # or of this one past the checkpoint it resumed from), which would make them refuse this run's as stale
        self._new_run = True
        self._accepted: tuple | None = None  # (group generation, mode, tensor specs) of the last update all took

    # ---- process group ----------------------------------------------------------------------------------------
    def init_process_group(self, group_name: str = "inflight_weights") -> None:
        """Host the store, ask every server to join (concurrently), and join as rank 0."""
        if self.transport != "process_group":
            return  # the file and shm transports need no group
        self._generation += 1
        self.master_port = self.master_port or free_port()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # wait_for_workers=False: otherwise the constructor blocks until every server has connected.
        self.store = TCPStore(self.master_address, self.master_port, self.world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        posts = [self.pool.submit(self.post, url, "/init_process_group", {
            "master_address": self.master_address, "master_port": self.master_port, "rank_offset": 1 + i,
            "world_size": self.world_size, "backend": self.backend, "group_name": group_name,
            "timeout_s": min(self.timeout_s, MAX_GROUP_TIMEOUT_S)}) for i, url in enumerate(self.urls)]

        def build() -> Any:
            if self.backend == "gloo":
                return ProcessGroupGloo(self.store, 0, self.world_size, timeout)
            from torch.distributed import ProcessGroupNCCL  # lazy: CUDA builds of torch only

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return ProcessGroupNCCL(self.store, 0, self.world_size, opts)

        # Build our side on its own thread and watch the servers' answers meanwhile: a server that refuses (or
        # cannot be reached) fails the call at once instead of after the group's timeout.
        group: cf.Future = cf.Future()
        build_here = on_device(self.device, build)
        self._group_thread = threading.Thread(target=lambda: run_into(group, build_here), name="weight-group",
                                              daemon=True)
        self._group_thread.start()  # after a fast failure it ends at the group timeout; close() waits for it
        pending = {group, *posts}
        while group in pending:
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            if any(p in done and p.exception() is not None for p in posts):
                self.collect([p for p in posts if p.done()], "init_process_group")  # raises, naming the server
        if group.exception() is not None:
            self.collect(posts, "init_process_group")  # a server's own error explains it best
        self.group = group.result()
        self.collect(posts, "init_process_group")
        log.info("weight group up: %d servers, %s:%d (%s)", len(self.urls), self.master_address, self.master_port,
                 self.backend)

    # ---- updates ----------------------------------------------------------------------------------------------
    def prepare(self, named_weights: Iterable[tuple[str, torch.Tensor]]) -> PreparedUpdate | list:
        """For tensors made fresh for this push (an FSDP2 gather, one at a time): each converted to the servers'
        dtype and packed into its bucket as it comes (prepared.py), so the update exists once, in the wire dtype.
        push() takes the result as often as needed: a retry resends it. Other transports: the converted tensors.
        Each tensor must come once (no tied aliases)."""
        if self.transport != "process_group":
            return [(n, self._convert(t)) for n, t in named_weights]
        return prepare_update(named_weights, self._convert, self.bucket_bytes)

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]] | PreparedUpdate, version: int,
             mode: str = "keep", adapter: dict | None = None) -> dict:
        """Send new weights to every server; returns {bytes, seconds, pause_s: {url: s}, version}. `adapter`
        ({"rank", "scaling"}): the tensors are a LoRA adapter's `<base>.lora_A` / `<base>.lora_B`, checked here
        as the servers will (contracts.adapter_pairs), on every transport. `named_weights` may be what prepare()
        returned."""
        t0 = time.perf_counter()
        extra: dict[str, Any] = {"adapter": AdapterSpec(**adapter).model_dump()} if adapter is not None else {}
        if self._new_run:
            extra["new_run"] = True
        if isinstance(named_weights, PreparedUpdate):
            prepared = named_weights
            if prepared.bucket_bytes != self.bucket_bytes:
                raise ValueError(f"prepared for bucket_bytes={prepared.bucket_bytes}, the client has "
                                 f"{self.bucket_bytes}")
            nbytes, ntensors = prepared.nbytes, len(prepared.params)
            self._check_adapter(prepared.params, extra)
            answers = self._push_broadcast(prepared.params, lambda announced: prepared.payload, version, mode, extra)
        elif self.transport in ("shm", "cuda_ipc"):  # converted while copied into the segment / buffer
            tensors = [(n, self._check_dtype(t.detach())) for n, t in unique_tensors(named_weights)]
            itemsize = {n: (self.dtype or t.dtype).itemsize for n, t in tensors}
            nbytes, ntensors = sum(t.numel() * itemsize[n] for n, t in tensors), len(tensors)
            self._check_adapter(_params(tensors, self.dtype), extra)
            answers = self._push_shm(tensors, version, mode, extra) if self.transport == "shm" else \
                push_ipc(self, tensors, version, mode, extra)
        else:
            tensors = [(n, self._convert(t)) for n, t in unique_tensors(named_weights)]
            nbytes, ntensors = sum(t.numel() * t.element_size() for _, t in tensors), len(tensors)
            params = _params(tensors, None)
            self._check_adapter(params, extra)
            if self.transport == "file":
                answers = self._push_file(tensors, version, mode, extra)
            else:
                answers = self._push_broadcast(params, lambda announced: self._pack(tensors, params, announced),
                                               version, mode, extra)
        seconds = time.perf_counter() - t0
        self._new_run = False
        pause = {url: float(a["pause_s"]) for url, a in zip(self.urls, answers)}
        log.info("pushed v%d%s: %d tensors, %.1f MB in %.3fs (%.0f MB/s), max pause %.3fs", version,
                 " (adapter)" if "adapter" in extra else "", ntensors, nbytes / 1e6, seconds,
                 nbytes / 1e6 / max(seconds, 1e-9), max(pause.values()))
        out = {"version": version, "bytes": nbytes, "seconds": seconds, "pause_s": pause,
               "num_tensors": ntensors, "adapter": "adapter" in extra}
        if self.transport in ("shm", "cuda_ipc"):
            out["write_s"] = self.last_write_s  # of `seconds`: writing the segment
        return out

    def _check_adapter(self, params: list[dict], extra: dict) -> None:
        """An adapter update's names, ranks and shapes, before anything is sent (the servers check them too)."""
        if "adapter" not in extra:
            return
        try:
            adapter_pairs([ParamInfo(**p) for p in params], extra["adapter"]["rank"])
        except ValueError as e:
            raise WeightSyncError(f"not an adapter update: {e}") from None

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return self._check_dtype(t).contiguous()

    def _check_dtype(self, t: torch.Tensor) -> torch.Tensor:
        if (self.dtype or t.dtype) not in DTYPE_NAMES or not t.is_floating_point():
            raise WeightSyncError(f"cannot send dtype {t.dtype} (float32, bfloat16, float16 only)")
        return t

    def _push_broadcast(self, params: list[dict], payload_of, version: int, mode: str, extra: dict) -> list[dict]:
        """params: the announcement; payload_of(announced): the buffers to broadcast, in order."""
        if self.group is None:
            raise WeightSyncError("call init_process_group() before push()")
        body = {"version": version, "mode": mode, "params": params, **extra}
        if self.bucket_bytes:
            body["bucket_bytes"] = self.bucket_bytes
        # dry run first: a server that would reject must not leave the others waiting. The servers check the
        # announced names, shapes and dtypes against their model, so an announcement they all took on this group
        # is not checked again (one round trip less per step, on the path from optimizer step to new weights)
        announced = (self._generation, mode, tuple((p["name"], tuple(p["shape"]), p["dtype"]) for p in params),
                     tuple(sorted(extra.get("adapter", {}).items())))
        if self.precheck and announced != self._accepted:
            self.collect([self.pool.submit(self.post, u, "/check_weight_update", body, True) for u in self.urls],
                          "check_weight_update")
        posts = [self.pool.submit(self.post, u, "/request_weight_update", body) for u in self.urls]
        generation = self._generation
        sender: cf.Future = cf.Future()
        payload = payload_of(announced)
        send = on_device(self.device, lambda: self._send_all(payload, generation))
        threading.Thread(target=lambda: run_into(sender, send), name=f"broadcast-v{version}", daemon=True).start()
        pending: set[cf.Future] = {sender, *posts}
        while sender in pending:  # a server whose request fails has left the broadcast: stop at once
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            failed = [p.exception() for p in posts if p in done and p.exception() is not None]
            if failed:
                if all(isinstance(e, ServerAnswered) for e in failed):
                    # a server that rejected what it fully received (NaN/Inf) answers while our last sends may
                    # still be completing: give them a moment, so that the group survives a rejection of content
                    # (a server that is gone gets no grace: the abort must free the others at once)
                    cf.wait({sender}, timeout=SENDER_GRACE_S)
                break
        if not sender.done() or sender.exception() is not None:
            reason = str(sender.exception()) if sender.done() else "a server's request failed"
            t0 = time.perf_counter()
            self.abort_group(generation)  # the servers still receiving fail now, not at the group timeout
            try:  # each server's own answer names it (the dead one: a connection error)
                self.collect(posts, "request_weight_update", timeout_s=ABORT_ANSWER_S)
            except WeightSyncError as e:
                raise WeightSyncError(f"broadcast of v{version} broke off ({reason[:300]}); weight group aborted, "
                                      f"servers answered in {time.perf_counter() - t0:.2f}s: {e}") from None
            raise WeightSyncError(f"broadcast of v{version} failed: {reason}")
        answers = self.collect(posts, "request_weight_update")
        self._accepted = announced
        return answers

    def _pack(self, tensors: list[tuple[str, torch.Tensor]], params: list[dict],
              announced: tuple) -> list[torch.Tensor]:
        """What to broadcast, in order: each bucket of `bucket_layout` (a lone tensor as it is, several packed into
        one uint8 buffer). Layout and buffers are kept for the next push of the same announcement."""
        key = (announced, self.bucket_bytes)
        if self._layout is None or self._layout[0] != key:
            infos = [ParamInfo(**p) for p in params]
            buckets = bucket_layout(infos, self.bucket_bytes)
            sizes = [packed_bytes(infos, b) for b in buckets]
            self._layout = (key, buckets, sizes)
            self._buckets = [torch.empty(n, dtype=torch.uint8, device=tensors[0][1].device) for n in sizes if n]
        _, buckets, sizes = self._layout
        out, packed = [], iter(self._buckets)
        for bucket, n in zip(buckets, sizes):
            if not n:
                out.append(tensors[bucket[0][0]][1])
                continue
            buf = next(packed)
            for i, offset in bucket:
                t = tensors[i][1]
                buf[offset: offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            out.append(buf)
        return out

    def _send_all(self, payload: list[torch.Tensor], generation: int) -> None:
        """Broadcast every buffer: all posted at once, in order, then waited for (the waits release the GIL; one at a
        time, each send waited for the GIL of a busy trainer first). The group is read from self.group and never
        kept in a local: a frame or a traceback holding it would keep its connections open after abort_group."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if self._generation != generation or self.group is None:
            raise WeightSyncError(f"weight group aborted before the first of {len(payload)} broadcasts")
        works = [self.group.broadcast([t], opts) for t in payload]
        try:
            for i in range(len(works)):
                if self._generation != generation:
                    raise WeightSyncError(f"weight group aborted after {i} of {len(payload)} broadcasts")
                works[i].wait()
        finally:
            works.clear()  # a pending op holds the group: the traceback of an error must not keep it

    def abort_group(self, generation: int | None = None) -> None:
        """Drop our end of the weight group (only if it is still `generation`'s): its connections close and every
        server blocked in a broadcast fails at once. The next push needs init_process_group() again."""
        if generation is not None and generation != self._generation:
            return  # the group was re-formed meanwhile
        had_group = self.group is not None
        self.drop_group()
        if had_group:
            log.warning("weight group aborted (%d servers): the next push forms it again", len(self.urls))

    def drop_group(self) -> None:
        """Let go of the weight group (an abort, a rejoin, close): a sender still using it stops, and it is shut down
        and freed off this thread (release_group); close() waits until it is gone."""
        self._generation += 1
        held, self.group, self.store = [self.group], None, None
        self._releases = [t for t in self._releases if t.is_alive()]
        if held[0] is not None:
            self._releases.append(release_group(held, self.backend))

    def _push_shm(self, tensors: list[tuple[str, torch.Tensor]], version: int, mode: str,
                  extra: dict) -> list[dict]:
        """Announce the segment (reused while the announcement stays the same) to every server and write it
        meanwhile: each server copies the tensors as they are written and applies them at its next step boundary
        once the segment is complete (transport/shm.py; where progress_is_ordered() is false, the segment is written
        first and then posted). After a failure the segment is replaced; a failure while writing marks it
        abandoned, so the servers following it answer at once."""
        assert self._shm is not None
        dtypes = [DTYPE_NAMES[self.dtype or t.dtype] for _, t in tensors]
        announced = ("shm", mode, tuple((n, tuple(t.shape), d) for (n, t), d in zip(tensors, dtypes)),
                     tuple(sorted(extra.get("adapter", {}).items())))
        params = [{"name": n, "shape": list(t.shape), "dtype": d} for (n, t), d in zip(tensors, dtypes)]
        if self._shm_layout is None or self._shm_layout[0] != announced[2]:
            infos = [ParamInfo(**p) for p in params]
            self._shm_layout = (announced[2], *shm_layout(infos), announcement_digest(infos))
        _, offsets, data_bytes, digest = self._shm_layout
        try:
            segment = self._shm.begin(data_bytes, version, digest)
        except ShmError as e:
            raise WeightSyncError(str(e)) from None
        body = {"version": version, "mode": mode, "params": params, "shm": segment, **extra}
        try:
            if self.precheck and announced != self._accepted:
                self.collect([self.pool.submit(self.post, u, "/check_weight_update", body, True)
                               for u in self.urls], "check_weight_update")
            overlap = progress_is_ordered()
            posts = [self.pool.submit(self.post, u, "/request_weight_update", body) for u in self.urls] \
                if overlap else []
            t0 = time.perf_counter()
            try:
                self._shm.write_tensors(tensors, dtypes, offsets)
            except BaseException as e:
                self._shm.abandon()  # the servers following the segment give up now, not at their stall timeout
                if posts and isinstance(e, Exception):
                    try:
                        self.collect(posts, "request_weight_update", timeout_s=ABORT_ANSWER_S)
                    except WeightSyncError as answered:
                        log.warning("writing the segment of v%d failed; the servers answered: %s", version, answered)
                raise
            self._shm.finish()
            self.last_write_s = time.perf_counter() - t0
            if not overlap:
                posts = [self.pool.submit(self.post, u, "/request_weight_update", body) for u in self.urls]
            answers = self.collect(posts, "request_weight_update")
        except BaseException:
            self._shm.discard()  # a server may still read the old file: never write it again
            raise
        self._accepted = announced
        return answers

    def _push_file(self, tensors: list[tuple[str, torch.Tensor]], version: int, mode: str,
                   extra: dict) -> list[dict]:
        final = os.path.join(self.shm_dir, f"inflight-weights-{uuid.uuid4().hex[:8]}-v{version}.safetensors")
        tmp = final + ".tmp"
        try:
            save_file({n: t for n, t in tensors}, tmp)
            os.replace(tmp, final)  # servers never see a half-written file
            body = {"version": version, "mode": mode, "path": final, **extra}
            return self.collect([self.pool.submit(self.post, u, "/request_weight_update", body) for u in
                                  self.urls], "request_weight_update")
        finally:
            for p in (tmp, final):
                if os.path.exists(p):
                    os.remove(p)

    def close(self) -> None:
        if self._group_thread is not None:  # a set-up abandoned on a fast failure: no thread outlives the client
            self._group_thread.join(timeout=self.timeout_s + 5)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
        self.drop_group()
        for thread in self._releases:  # an op still in flight ends by the group timeout at the latest
            thread.join(timeout=self.timeout_s + 5)
        if self._shm is not None:
            self._shm.discard()
        if self._ipc is not None:
            self._ipc.discard()


def check_config(cfg: RunConfig) -> None:
    """Every trainer setting works with the contract (adapter updates included)."""


def make_client(cfg: RunConfig, server_urls: list[str], common: dict[str, Any]) -> WeightSyncClient:
    t = cfg.trainer
    return WeightSyncClient(server_urls, transport=t.weight_transport, shm_dir=t.shm_dir,
                            bucket_bytes=int(t.weight_bucket_mb * 2**20), **common)
