"""Server side of the weight-update contract: join the trainer's process group, validate an announced update,
receive it (broadcasts from rank 0, a shared-memory segment of the same host, or a safetensors file), and hand it to
the engine all at once.

Rules (docs/inference-contract.md; the checks themselves: update_checks.py): an announcement is checked against
`engine.param_specs()` before anything is received — unknown name, a tied alias (the shared tensor travels once,
under its canonical name), wrong shape, wrong dtype or a duplicate is a `WeightUpdateError` (HTTP 400) and nothing
changes; a file's tensors are checked from its header first. A version older than the one served is a 409 on every
transport (checked at once, and again under the update lock). A subset of the parameters is a valid (partial)
update. Tensors land in fresh buffers while the engine keeps generating; the engine then swaps them in with one
`load_weights` call inside `run_paused` (the only pause), so the model is never half-updated.
With `reject_nonfinite` (default), a tensor holding NaN or Inf rejects the whole update (400) after it has been
received and before anything is applied: the weights stay as they were. The check is one fused reduction per update
(one host sync, not one per tensor); only a non-finite total looks at each tensor, to name them. An adapter update
is checked again after its merge: finite A and B whose W0 + scaling * B @ A overflows are refused the same way.
A shared-memory update is copied once by the server, and what is checked is that copy: the trainer keeps the segment
writable, so nothing is read from it twice. Its header is checked at once (format, version, the
announcement's digest) and the segment is mapped. The trainer may still be writing it (transport/shm.py, format 2):
on the built-in llama path on CPU (`runner.double_buffer`) each tensor is copied into the runner's spare storage as
soon as the trainer has written it, while the engine keeps generating, checked for NaN/Inf in the same pass
(`LlamaRunner.stage`), so the two copies of a push overlap; the pause only re-points the model at that storage
(measured on SmolLM2's 538 MB: the copy in the pause, and the wait for the step boundary before it, were most of a
push; docs/benchmarks.md). What stage() does not take (and everything elsewhere) is copied out of the complete
segment into fresh memory, checked as it is copied, and the pause copies it into the model. Nothing is applied
before the segment is complete with the announced header; a trainer that abandons the update or stops writing (no
progress for INFLIGHT_SHM_STALL_S) is a 409, nothing applied. The trainer writes the segment again only after every
server answered.

A join runs in a thread of its own and holds no lock: file, shm and ipc updates go on while a rendezvous waits
(broadcasts answer 409 until it is done), and a newer `/init_process_group` supersedes it (the older request
answers 409 at once; its thread ends by its timeout and never builds a group). A join also supersedes a receive
still blocked on the old group: the trainer forms a group again only after it gave up on the old one, and a gloo
receive whose sender is gone may not fail before the group timeout. The update then answers 409 at once (nothing
applied) and the server joins the new group; the blocked receive is left to end on its own, and it never touches
the new group.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from inflight.transport.schemas import AdapterSpec, InitProcessGroupRequest, ParamInfo, WeightUpdateRequest

from inflight.transport.layout import bucket_layout, packed_bytes, shm_layout
from inflight.engine.weights.adapter_merge import AdapterState, bases_of
from inflight.engine.weights.ipc_receiver import IpcReceiver
from inflight.engine.weights.checks import (WeightUpdateError, check_announced, check_finite, check_shm, check_tensors,
                                           check_version, file_params, read_file, refuse_nonfinite)
from inflight.transport.cuda_ipc import IpcError
from inflight.transport.finite import private_copies
from inflight.transport.shm import SegmentWatch, ShmError, ShmMapping, announcement_digest

__all__ = ["WeightReceiver", "WeightUpdateError", "check_finite", "unpack"]
log = logging.getLogger("inflight.engine.weights")
MAX_JOINS_WAITING = 4  # rendezvous threads a server keeps waiting at once (each ends by its timeout_s at the latest)


class WeightReceiver:
    """Owns the weight-update process group of one server and applies updates to its engine."""

    def __init__(self, engine: Any, device: str = "cpu", reject_nonfinite: bool = True):
        self.engine = engine
        self.aliases: dict[str, str] = getattr(engine, "tied_aliases", None) or {}  # refused, named in the 400
        self.device = device
        self.reject_nonfinite = reject_nonfinite
        self.group: Any = None
        self.rank = -1
        self.world_size = 0
        self._lock = asyncio.Lock()  # one update at a time
        self._superseded: asyncio.Event | None = None  # set by a join while an update is receiving
        self._joins = 0  # joins started: only the latest one may install its group
        self._joining: asyncio.Event | None = None  # the join waiting for its rendezvous (set: superseded)
        self._join_threads = 0  # rendezvous threads still running, superseded ones included
        self._shm = ShmMapping()  # the trainer's segment, mapped once while it reuses it
        self.ipc = IpcReceiver(device)  # the trainer's device buffer (cuda_ipc), opened once while it keeps it
        self.adapters = AdapterState()  # W0 of adapted weights, the adapter being served (adapter_merge.py)
        self.updates = 0
        self.last_update: dict[str, Any] = {}

    # ---- process group --------------------------------------------------------------------------------------
    async def init_process_group(self, req: InitProcessGroupRequest, connect_to: str | None = None) -> dict[str, Any]:
        """`connect_to`: the checked IP of req.master_address (the server resolves and vets the name first)."""
        if req.rank_offset >= req.world_size:
            raise WeightUpdateError(f"rank_offset {req.rank_offset} must be < world_size {req.world_size}")
        if req.backend == "nccl" and not torch.cuda.is_available():
            raise WeightUpdateError("backend 'nccl' needs a CUDA device; this server has none (use 'gloo')")
        if self._join_threads >= MAX_JOINS_WAITING:  # a thread per join: never an unbounded number of them
            raise WeightUpdateError(f"{self._join_threads} process-group joins are still waiting for their "
                                    "rendezvous (each ends by its timeout_s); retry later", status=409)
        if self._superseded is not None:
            self._superseded.set()  # the receive in progress is on the group this join replaces
        if self._joining is not None:
            self._joining.set()  # so is a join still waiting: the trainer gave up on it
        self._joins += 1
        seq, mine = self._joins, asyncio.Event()
        self._joining = mine
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(group: Any, error: BaseException | None) -> None:
            self._join_threads -= 1
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(group)

        def join() -> None:  # a thread of its own: a long rendezvous never occupies the default executor
            group, error = None, None
            try:
                group = _join_group(req, connect_to or req.master_address, lambda: self._joins == seq)
            except BaseException as e:  # reported to the request (500), or dropped if it was superseded
                error = e
            with contextlib.suppress(RuntimeError):  # the server shut down while this join waited
                loop.call_soon_threadsafe(settle, group, error)

        self._join_threads += 1
        threading.Thread(target=join, name="inflight-join", daemon=True).start()
        log.info("joining weight group %s via %s:%d (rank %d of %d, waiting up to %gs for the rendezvous)",
                 req.group_name, req.master_address, req.master_port, req.rank_offset, req.world_size, req.timeout_s)
        stop = asyncio.ensure_future(mine.wait())
        try:
            await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if self._joining is mine:
                self._joining = None
        if self._joins != seq:
            done.add_done_callback(lambda f: f.exception())  # nobody waits for it any more
            log.warning("join of weight group via %s:%d superseded by a newer /init_process_group",
                        req.master_address, req.master_port)
            raise WeightUpdateError("superseded by a newer /init_process_group while waiting for the rendezvous; "
                                    "this join was given up", status=409)
        self.group = done.result()  # the join's error, if it failed (the route answers 500)
        self.rank, self.world_size = req.rank_offset, req.world_size
        log.info("joined weight group %s: rank %d of %d via %s:%d (%s)", req.group_name, req.rank_offset,
                 req.world_size, req.master_address, req.master_port, req.backend)
        return {"rank": self.rank, "world_size": self.world_size, "backend": req.backend}

    # ---- updates ----------------------------------------------------------------------------------------------
    def validate(self, req: WeightUpdateRequest) -> None:
        """Every check that needs nothing received (also the dry run /check_weight_update): the version rule, the
        announcement (or a file's header) against the model, a segment's header, an ipc handle."""
        check_version(req.version, self.engine.version, req.new_run)
        if req.path is not None:
            check_announced(file_params(req.path), req.adapter, self.engine.param_specs(), self.aliases)
            return
        if req.shm is None and req.ipc is None:
            if self._joining is not None:
                raise WeightUpdateError("a /init_process_group is waiting for its rendezvous: broadcast updates "
                                        "wait for the new group", status=409)
            if self.group is None:
                raise WeightUpdateError("no process group: POST /init_process_group first", status=409)
        self._receive_specs(req)
        if req.shm is not None:
            check_shm(req)
        if req.ipc is not None:
            self._ipc(self.ipc.validate, req)

    def _ipc(self, fn, req: WeightUpdateRequest) -> Any:
        try:
            return fn(req, self.engine.version)
        except IpcError as e:
            raise WeightUpdateError(f"weight update rejected: {e}; nothing applied, weights stay at "
                                    f"v{self.engine.version}", status=e.status) from None

    def _receive_specs(self, req: WeightUpdateRequest) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Check the announced tensors (400 naming every problem); their {name: (shape, dtype)} to receive."""
        return check_announced(req.params or [], req.adapter, self.engine.param_specs(), self.aliases)

    @contextlib.asynccontextmanager
    async def _incoming(self) -> AsyncIterator[None]:
        """The engine's evaluation steps wait while this update is received and applied (core.py)."""
        incoming = getattr(self.engine, "update_incoming", None)
        with incoming() if incoming is not None else contextlib.nullcontext():
            yield

    async def update(self, req: WeightUpdateRequest) -> dict[str, Any]:
        """Validate at once (raises before receiving anything), then receive and apply at a step boundary."""
        await asyncio.to_thread(self.validate, req)  # may read a file's or a segment's header
        if self._lock.locked():
            raise WeightUpdateError("another weight update is in progress", status=409)
        async with self._lock, self._incoming():
            check_version(req.version, self.engine.version, req.new_run)  # again: one may have been applied meanwhile
            if req.ipc is not None and req.version == self.engine.version and not req.new_run:  # a retry (transport/cuda_ipc.py)
                log.info("weight update v%d: already held, nothing copied", req.version)
                return {"version": req.version, "pause_s": 0.0, "applied": False}
            t0 = time.perf_counter()
            if req.path is not None:
                tensors = await asyncio.to_thread(read_file, req.path)  # read before pausing
                check_tensors(tensors, self.engine.param_specs(), self.aliases, req.adapter)
            elif req.ipc is not None:  # views of the trainer's device buffer: copied in, in place, in the pause
                tensors = await asyncio.to_thread(self._ipc, self.ipc.tensors, req)
            elif req.shm is not None:  # views of the segment (maybe still being written): copied out once, below
                tensors, watch = await asyncio.to_thread(self._map_shm, req)
            else:  # received while the engine keeps generating (on the old weights); it pauses only to apply
                tensors = await self._receive_unless_superseded(req.params or [], self._receive_specs(req),
                                                                req.version, req.bucket_bytes)
            adapter, prepared, unstaged, checked = req.adapter, [], tensors, False
            runner = self.engine.runner
            if req.shm is not None:
                if adapter is None and getattr(runner, "double_buffer", False):
                    # copied (and checked) into the runner's spare storage while the engine generates, each
                    # tensor once the trainer has written it: the pause only re-points the model at it
                    prepared, unstaged, bad = await self._follow(req, runner.stage, tensors, self.reject_nonfinite,
                                                                 watch.ready)
                    if bad:
                        refuse_nonfinite(bad)
                await self._follow(req, watch.wait_complete)  # the rest is read only from a complete segment
                # ... and only once: the trainer can still write the segment, so what is checked
                # and applied is a copy of our own, never the segment read again
                unstaged, bad = await asyncio.to_thread(private_copies, unstaged, self.reject_nonfinite)
                if bad:
                    refuse_nonfinite(bad)
                tensors, checked = {**tensors, **unstaged}, True
            if self.reject_nonfinite and not checked:  # a broadcast was received whole: the group stays in step
                await asyncio.to_thread(check_finite, unstaged)
            read_s = time.perf_counter() - t0
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            ntensors = len(tensors)
            if adapter is not None:  # merged off the engine thread, into new buffers: the pause only swaps them
                load = await asyncio.to_thread(self.adapters.merged, dict(self.engine.model.named_parameters()),
                                               tensors, adapter.scaling)
                if self.reject_nonfinite:  # finite A and B can still overflow W0 + scaling * B @ A
                    await asyncio.to_thread(check_finite, load, "the merged weights W0 + scaling * B @ A of ")
                prepare = getattr(self.engine.runner, "prepare_swap", None)  # the fast llama path's fused storage
                if prepare is not None:
                    prepared, load = await asyncio.to_thread(prepare, load)  # what it cannot swap is copied
            else:  # what stage() did not take, and W0 of adapted bases the update leaves out
                load = self.adapters.with_reverts(tensors)
                if prepared:
                    load = {n: t for n, t in load.items() if n in unstaged or n not in tensors}

            def apply() -> float:
                p0 = started[0] = time.perf_counter()
                if prepared:  # every name was checked above: load_weights cannot refuse what follows
                    self.engine.runner.swap(prepared)
                self.engine.load_weights(load, req.version, req.mode)
                if adapter is not None:
                    self.adapters.served(bases_of(tensors), adapter.rank, adapter.scaling)
                else:
                    self.adapters.dropped()
                return time.perf_counter() - p0

            started, asked = [0.0], time.perf_counter()
            prepare_s = asked - t0 - read_s
            pause_s = await self.engine.run_paused(apply)
            if req.ipc is not None:
                await asyncio.to_thread(self.ipc.done)  # the trainer may write its buffer once we answered
        self.updates += 1
        total_s = time.perf_counter() - t0
        self.last_update = {"version": req.version, "pause_s": pause_s, "bytes": nbytes, "seconds": total_s,
                            "receive_s": read_s, "merge_s": prepare_s if adapter else 0.0,
                            "staged": 0 if adapter else len(prepared)}
        transport = "file" if req.path else "shm" if req.shm else "ipc" if req.ipc else "broadcast"
        what = (f"adapter rank {adapter.rank}, {len(prepared)} matrices swapped + {len(load)} copied (merged in "
                f"{prepare_s:.3f}s)" if adapter else f"full, {len(prepared)} matrices staged + {len(load)} copied"
                if prepared else "full")
        log.info("weight update v%d: %s, %s, %d tensors, %.1f MB, mode=%s, paused %.3fs, total %.3fs (received in "
                 "%.3fs, waited %.3fs for a step boundary)", req.version, transport, what, ntensors, nbytes / 1e6,
                 req.mode, pause_s, total_s, read_s, started[0] - asked)
        return {"version": req.version, "pause_s": pause_s}

    def adapt_before_start(self, tensors: dict[str, torch.Tensor], rank: int, scaling: float) -> None:
        """Serve W0 + scaling * B @ A from the start (`inflight serve --adapter`): checked like an adapter update,
        merged and copied in before the engine thread runs; W0 is kept, so the first adapter update replaces it."""
        if getattr(self.engine, "_thread", None) is not None:
            raise RuntimeError("adapt_before_start: the engine is already running (use an adapter update)")
        specs = self.engine.param_specs()
        # a saved adapter may be float32 for a bf16 model: round it once to the base's dtype, as a trainer would
        tensors = {n: t.to(specs[n.rsplit(".", 1)[0]][1]) if n.rsplit(".", 1)[0] in specs else t
                   for n, t in tensors.items()}
        adapter = AdapterSpec(rank=rank, scaling=scaling)
        check_tensors(tensors, specs, self.aliases, adapter)
        if self.reject_nonfinite:
            check_finite(tensors)
        params = dict(self.engine.model.named_parameters())
        load = self.adapters.merged(params, tensors, scaling)
        if self.reject_nonfinite:
            check_finite(load, "the merged weights W0 + scaling * B @ A of ")
        with torch.no_grad():
            for name, t in load.items():
                params[name].data.copy_(t)  # in place: the fast path's fused matrices are these tensors
        self.engine.runner.after_weight_update()
        self.adapters.served(bases_of(tensors), rank, scaling)
        log.info("serving an adapter of rank %d (scaling %g) merged into %d weights", rank, scaling, len(load))

    def _map_shm(self, req: WeightUpdateRequest) -> tuple[dict[str, torch.Tensor], SegmentWatch]:
        params = req.params or []
        offsets, data_bytes = shm_layout(params)
        check_shm(req)  # again, now that we hold the lock: the announced version is what we map
        assert req.shm is not None  # check_shm read it
        views = self._shm.tensors(req.shm.path, [(p.name, p.shape, p.dtype, off) for p, off in zip(params, offsets)])
        return views, self._shm.watch(req.version, data_bytes, announcement_digest(params))

    async def _follow(self, req: WeightUpdateRequest, fn, *args) -> Any:
        """fn(*args) off the event loop; a segment the trainer abandoned or stopped writing is a 409."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ShmError as e:
            log.warning("weight update v%d: %s; nothing applied", req.version, e)
            raise WeightUpdateError(f"weight update rejected: {e}; nothing applied, weights stay at "
                                    f"v{self.engine.version}", status=409) from None

    async def _receive_unless_superseded(self, params: list[ParamInfo], specs: dict, version: int,
                                         bucket_bytes: int) -> dict[str, torch.Tensor]:
        self._superseded = superseded = asyncio.Event()
        receive = asyncio.ensure_future(asyncio.to_thread(self._receive_all, self.group, params, specs, version,
                                                          bucket_bytes))
        stop = asyncio.ensure_future(superseded.wait())
        try:
            await asyncio.wait({receive, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._superseded = None
            stop.cancel()
        if receive.done():
            return receive.result()
        receive.add_done_callback(lambda f: f.exception())  # it ends with the old group's error; nobody waits
        log.warning("weight update v%d superseded by a new /init_process_group while receiving; nothing applied",
                    version)
        raise WeightUpdateError(f"weight update v{version} superseded by a new /init_process_group while receiving; "
                                f"nothing applied, weights stay at v{self.engine.version}", status=409)

    def _receive_all(self, group: Any, params: list[ParamInfo], specs: dict, version: int,
                     bucket_bytes: int = 0) -> dict[str, torch.Tensor]:
        """Every announced tensor (one broadcast per bucket of `bucket_layout`; bucket_bytes 0: per tensor), or
        WeightUpdateError 409 if the broadcast breaks off (the trainer aborted the group, or a peer died): what was
        received is dropped, nothing is applied, and the broken group is let go, so the next /init_process_group
        forms a new one."""
        buckets = bucket_layout(params, bucket_bytes)
        done = 0
        try:
            # every receive is posted at once, in the announced order, then waited for: the waits release the GIL,
            # while posting one receive at a time waited for the GIL between tensors (the engine thread holds it
            # for up to the 5 ms switch interval), which made a 30-tensor update 10x slower on a busy server
            sizes = [packed_bytes(params, b) for b in buckets]
            bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) if n else
                    torch.empty(tuple(params[b[0][0]].shape), dtype=specs[params[b[0][0]].name][1], device=self.device)
                    for b, n in zip(buckets, sizes)]
            works = [group.broadcast([b], _bcast_opts(root=0)) for b in bufs]
            try:
                for work in works:
                    work.wait()
                    done += 1
            finally:
                works.clear()  # pending ops hold the group, which must go when it broke
        except Exception as e:  # gloo: connection closed / reset, or the group timeout
            if self.group is group:  # a join may have replaced it meanwhile
                self.group = None
            raise WeightUpdateError(
                f"weight broadcast of v{version} broke off after {done} of {len(buckets)} broadcasts "
                f"({str(e).splitlines()[0][:200]}); nothing applied, weights stay at v{self.engine.version}; "
                "POST /init_process_group again", status=409) from None
        received: dict[str, torch.Tensor] = {}
        for bucket, buf, n in zip(buckets, bufs, sizes):
            for i, offset in bucket:  # views into the bucket: load_weights copies them into the model
                p = params[i]
                received[p.name] = unpack(buf, offset, p.shape, specs[p.name][1]) if n else buf
        return received


def unpack(buf: torch.Tensor, offset: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` and `dtype` at byte `offset` of a flat uint8 bucket (a view, no copy)."""
    n = dtype.itemsize * _numel(shape)
    return buf[offset: offset + n].view(dtype).view(tuple(shape))


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _bcast_opts(root: int) -> Any:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return opts


def _join_group(req: InitProcessGroupRequest, address: str, current: Callable[[], bool]) -> Any:
    """Build the group on the trainer's TCPStore, without a key prefix and without a default group. `current()`
    false: a newer join superseded this one while it connected, so it takes no part in the rendezvous (None)."""
    timeout = datetime.timedelta(seconds=req.timeout_s)
    store = TCPStore(address, req.master_port, req.world_size, is_master=False, timeout=timeout)
    if not current():
        return None
    if req.backend == "gloo":
        return ProcessGroupGloo(store, req.rank_offset, req.world_size, timeout)
    from torch.distributed import ProcessGroupNCCL  # lazy: only in CUDA builds of torch (same rendezvous)

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, req.rank_offset, req.world_size, opts)
