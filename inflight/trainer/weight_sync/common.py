"""What every weight client shares (inflight's own, inflight.py, and the stock-server ones): JSON posts to every server with errors that name the server, and the
trainer's side of a weight group (rank 0 hosts the TCPStore; the servers join as ranks 1..).

SGLang's receivers build their group with `init_custom_process_group` (TorchGroup below says exactly how); vLLM's
NCCL receivers need vLLM's own communicator (vllm.py). A tensor registered under several names (tied embeddings) is
sent once, under its first name. On a CUDA trainer the threads that build and drive the communicator make the
trainer's device current first (a new thread starts on device 0).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

import httpx
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from inflight.process import free_port

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupNCCL

log = logging.getLogger("inflight.trainer.weight_sync")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


class WeightSyncError(RuntimeError):
    """A server rejected an update, failed, or did not answer in time (the message names it)."""


class ServerAnswered(WeightSyncError):
    """The server answered with an error status: it is alive and has left the request (a broadcast included)."""


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor once: a later name for the same storage (a tied alias such as lm_head.weight) is dropped."""
    seen, out = set(), []
    for name, t in named:
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
               t.dtype) if t.numel() else None
        if key is not None and key in seen:
            log.debug("not sending %s: it shares its storage with a tensor sent under another name", name)
            continue
        seen.add(key)
        out.append((name, t))
    return out


def on_device(device: torch.device | None, fn):
    """fn, run with `device` current (CUDA keeps the current device per thread; a new thread starts on 0)."""
    if device is None or device.type != "cuda":
        return fn

    def bound():
        torch.cuda.set_device(device)
        return fn()

    return bound


def cuda_device(device: str | torch.device | None) -> torch.device | None:
    """The CUDA device the helper threads make current (None on CPU); "cuda" alone: the caller's current one."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def release_group(held: list[Any], backend: str, wait_s: float = 0.0) -> threading.Thread:
    """Shut down the weight group taken out of `held` (the caller's only reference: none is left behind) and free it
    on a helper thread, returned, joined for up to `wait_s`. NCCL: abort(), its ops could otherwise wait forever on a
    dead peer; gloo: shutdown(), which returns at once even when a peer died. Freeing a gloo group waits for an op
    still in flight (a broadcast to a live peer that is not receiving) until its peer leaves or the group timeout:
    never on the caller's thread."""
    box = [held.pop()]

    def free() -> None:
        try:
            if backend == "nccl":
                box[0].abort()
            else:
                box[0].shutdown()
        except Exception as e:  # noqa: BLE001 - best effort: the group is freed below anyway
            # the text only: the exception (an AttributeError's .obj) must not keep the group alive in a log record
            log.warning("shutting down the weight group failed: %s", f"{type(e).__name__}: {e}")
        box.clear()  # the last reference: the destructor closes the connections

    thread = threading.Thread(target=free, name="weight-group-release", daemon=True)
    thread.start()
    thread.join(wait_s)
    return thread


class Broadcaster:
    """Rank 0 of a weight group: `send(tensor)` broadcasts one tensor to every other rank."""

    def send(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TorchGroup(Broadcaster):
    """Rank 0 of a gloo or NCCL group whose store keys follow `torch.distributed`'s `_new_process_group_helper`
    (`<group_name>/<device>/`), under `outer_prefix` when the receivers wrap their store in one more PrefixStore.

    SGLang 0.5.x does (`python/sglang/srt/utils/common.py`, `init_custom_process_group`, called by
    `ModelRunner.init_weights_update_group` in `python/sglang/srt/model_executor/model_runner.py`): its workers'
    `rendezvous("tcp://addr:port")` store is wrapped in `PrefixStore(group_name, store)` before
    `_new_process_group_helper` adds torch's own two prefixes, so `SGLangWeightSync` passes `outer_prefix=group_name`
    and both ends read and write the same keys."""

    def __init__(self, store: Any, world_size: int, backend: str, group_name: str, timeout: datetime.timedelta,
                 outer_prefix: str | None = None):
        self.pg: ProcessGroupGloo | ProcessGroupNCCL | None
        self.backend = backend
        device = "cpu" if backend == "gloo" else "cuda"
        if outer_prefix is not None:
            store = PrefixStore(outer_prefix, store)
        prefixed = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", store))
        if backend == "gloo":
            self.pg = ProcessGroupGloo(prefixed, 0, world_size, timeout)
        else:
            from torch.distributed import ProcessGroupNCCL  # lazy: CUDA builds of torch only

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = ProcessGroupNCCL(prefixed, 0, world_size, opts)

    def send(self, tensor: torch.Tensor) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if self.pg is None:
            raise WeightSyncError("the weight group is closed")
        self.pg.broadcast([tensor], opts).wait()  # type: ignore[union-attr]  # torch's stubs omit backends' collectives

    def close(self) -> None:
        held, self.pg = [self.pg], None
        if held[0] is not None:
            release_group(held, self.backend, wait_s=5.0)


class ProtocolClient:
    """HTTP plumbing and the push skeleton of a weight client; subclasses supply the routes (inflight.py: inflight's
    contract; vllm.py, sglang.py: stock servers)."""

    protocol = "?"

    def __init__(self, server_urls: list[str], *, api_key: str | None = None, master_address: str = "127.0.0.1",
                 master_port: int = 0, backend: str = "gloo", timeout_s: float = 600.0, dtype: str | None = None,
                 device: str | torch.device | None = None):
        if not server_urls:
            raise ValueError("no server urls")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
        self.urls = [u.rstrip("/") for u in server_urls]
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.timeout_s = backend, timeout_s
        self.dtype = DTYPES[dtype] if dtype else None
        self.device = cuda_device(device)  # made current on the threads that build and drive the group
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.pool = cf.ThreadPoolExecutor(max_workers=max(2, 2 * len(self.urls)), thread_name_prefix="weight-sync")
        self.ranks = [1] * len(self.urls)  # receiving ranks per server (tensor parallel size), set by init
        self.group: Broadcaster | None = None
        self.store: Any = None

    @property
    def world_size(self) -> int:
        return 1 + sum(self.ranks)

    def rank_offsets(self) -> list[int]:
        out, r = [], 1
        for n in self.ranks:
            out.append(r)
            r += n
        return out

    # ---- HTTP ---------------------------------------------------------------------------------------------------
    def request(self, url: str, method: str, path: str, body: dict | None = None,
                params: dict | None = None, optional: bool = False) -> dict:
        """One call to one server; an error names the server and the path. An answer with an error status (or
        SGLang's `success: false`) raises ServerAnswered: the server is alive and has left the request. `optional`:
        a route the server may not have (404 reads as {})."""
        try:
            r = self.http.request(method, url + path, json=body, params=params)
        except httpx.TimeoutException as e:
            raise WeightSyncError(f"server {url}: {path} timed out after {self.timeout_s:.0f}s") from e
        except httpx.HTTPError as e:
            raise WeightSyncError(f"server {url}: {path} failed: {e}") from e
        if optional and r.status_code == 404:
            return {}  # a backend without the optional route (e.g. the dry run /check_weight_update)
        try:
            data = r.json() if r.content else {}
        except ValueError:
            data = {"message": r.text[:500]}
        if r.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            raise ServerAnswered(f"server {url} rejected {path} (HTTP {r.status_code}): {error_text(data)}")
        return data if isinstance(data, dict) else {"value": data}

    def post(self, url: str, path: str, body: dict | None = None, optional: bool = False) -> dict:
        return self.request(url, "POST", path, body, optional=optional)

    def post_all(self, path: str, body: dict | Callable[[int], dict] | None = None,
                 params: dict | None = None) -> list[dict]:
        """POST to every server concurrently; `body` may depend on the server's index."""
        futures = [self.pool.submit(self.request, u, "POST", path, body(i) if callable(body) else body, params)
                   for i, u in enumerate(self.urls)]
        return self.collect(futures, path)

    # ---- weights ------------------------------------------------------------------------------------------------
    def convert(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for n, t in unique_tensors(named):
            t = t.detach()
            if self.dtype is not None and t.dtype != self.dtype:
                t = t.to(self.dtype)
            if t.dtype not in DTYPE_NAMES:
                raise WeightSyncError(f"cannot send {n} of dtype {t.dtype} (float32, bfloat16, float16 only)")
            out.append((n, t.contiguous()))
        return out

    def broadcast_with(self, path: str, body: dict, tensors: list[tuple[str, torch.Tensor]]) -> list[dict]:
        """POST `body` to every server (they start receiving) while we broadcast each tensor in order."""
        if self.group is None:
            raise WeightSyncError("call init_process_group() before push()")
        posts = [self.pool.submit(self.request, u, "POST", path, body) for u in self.urls]
        if self.device is not None:  # the caller may be a helper thread, on device 0 until told otherwise
            torch.cuda.set_device(self.device)
        try:
            for _, t in tensors:
                if any(p.done() and p.exception() is not None for p in posts):
                    break  # a server refused: it will not join this broadcast
                self.group.send(t)
        except Exception as e:
            self.collect(posts, path)  # a server's own error explains it best
            raise WeightSyncError(f"broadcast failed: {e}") from e
        return self.collect(posts, path)

    def host_group(self, join: Callable[[], list[dict]], make_group: Callable[[Any], Broadcaster],
                   host_store: bool = True) -> None:
        """Host the store (unless `make_group` hosts its own), run `join` (the servers' init requests) and build our
        side concurrently."""
        self.master_port = self.master_port or free_port()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if host_store:
            self.store = TCPStore(self.master_address, self.master_port, self.world_size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
        joined: cf.Future = cf.Future()
        threading.Thread(target=lambda: run_into(joined, join), name="weight-join", daemon=True).start()
        group: cf.Future = cf.Future()
        build = on_device(self.device, lambda: make_group(self.store))
        threading.Thread(target=lambda: run_into(group, build), name="weight-group", daemon=True).start()
        cf.wait([joined, group], return_when=cf.FIRST_EXCEPTION)
        if group.done() and group.exception() is not None:
            cf.wait([joined], timeout=5.0)  # a server's refusal explains it best
        refused = joined.exception() if joined.done() else None
        if refused is not None:
            raise refused  # a server refused: fail now, not after the group timeout
        if group.exception() is not None:
            raise WeightSyncError(f"could not form the weight group: {group.exception()}") from group.exception()
        self.group = group.result()
        joined.result()

    def collect(self, futures: list[cf.Future], what: str, timeout_s: float | None = None) -> list[dict]:
        """Every answer, or one WeightSyncError naming each failed server. With timeout_s, `futures` are the posts
        to self.urls in order (a server that does not answer in time is named by its url)."""
        errors, answers = [], []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for url, f in zip(self.urls, futures):
            try:
                answers.append(f.result(None if deadline is None else max(0.0, deadline - time.monotonic())))
            except cf.TimeoutError:
                errors.append(f"server {url}: no answer to {what} within {timeout_s:.0f}s")
            except Exception as e:
                errors.append(str(e))
        if errors:
            raise WeightSyncError(f"{what}: " + " | ".join(errors))
        return answers

    def drop_group(self) -> None:
        """Let go of the weight group (before forming it again, or at close): shut down and freed off this thread."""
        group, self.group, self.store = self.group, None, None
        if group is not None:
            group.close()

    def close(self) -> None:
        self.drop_group()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def run_into(future: cf.Future, fn: Callable[[], Any]) -> None:
    """fn's result or exception into `future` (fn runs on a helper thread; the caller waits on the future)."""
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
        future.set_exception(exc)


def error_text(data: Any) -> str:
    """The message of a server's error body, whatever its shape (OpenAI error, FastAPI detail, {message})."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])
    return str(data)[:500]
