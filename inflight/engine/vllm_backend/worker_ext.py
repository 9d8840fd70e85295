"""Runs INSIDE each vLLM worker (`--worker-extension-cls inflight.engine.vllm_backend.worker_ext.InflightWorkerExtension`):
vLLM mixes these methods into its Worker class, and the API process calls them with `collective_rpc(name, ...)`.

The worker, not the API process, joins the trainer's process group and receives the broadcasts (on a GPU the
tensors land straight in GPU memory; nothing goes through the API process). An update happens in two calls:
`inflight_receive` / `inflight_stage_file` / `inflight_stage_shm` put the new tensors aside ("staged") and check
them for NaN/Inf (one fused reduction), `inflight_apply` loads them all at once, so the model is never half-updated
and a rejected update changes nothing.

Memory: on a GPU, broadcasts are received bucket by bucket into one reused GPU buffer (the size of the largest
bucket) and staged in pinned host memory, kept for the next update of the same layout; the apply then loads from
the host. So an update needs one bucket of GPU memory, not a second copy of the model (which at vLLM's default
gpu_memory_utilization 0.9 does not fit for a 7B model). `staging="device"` stages on the GPU instead: a shorter
pause (no host-to-GPU copy in it) for a model's worth of free GPU memory (lower --gpu-memory-utilization by the
model's size). A shared-memory segment is staged as a host copy made before the pause, checked as it is copied: the
trainer can still write the segment, so the bytes checked are the bytes applied (and vLLM's CPU reload keeps the
tensors it is given).

Tied embeddings: the update carries the embedding once (`model.embed_tokens.weight`); vLLM loads it into the one
parameter both modules share, and on CPU the prepacked lm_head is rebuilt from it after every reload.

Adapter (LoRA) updates: `inflight_merge_staged(scaling)` turns the staged A/B pairs into merged weights
W0 + s * B @ A (HF names), refused like a NaN/Inf update when the merge overflows, which `inflight_apply` then loads like a full update, so vLLM fuses, shards and (on CPU)
prepacks them itself and generates at full-model speed. W0: on CPU the shadow checkpoint, which holds the base
weights (checkpoint + full updates; merged weights are never written into it, so bases an adapter no longer lists
are W0 again by construction); on a GPU a host copy of each adapted base, read from the checkpoint the first time
it is adapted and replaced by full updates that name it. A full update drops the adapter (its bases go back to W0
unless the update names them).

Only torch, safetensors, vLLM and three torch-only inflight modules (shm_weights, finite, engine.adapter_merge) are
imported here: this module runs in vLLM's environment.
"""

from __future__ import annotations

import datetime
import glob
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed import ProcessGroupGloo, TCPStore

from inflight.engine.weights.adapter_merge import LORA_A, LORA_B, bases_of, merge
from inflight.transport.finite import nonfinite, private_copies
from inflight.transport.shm import ShmMapping

log = logging.getLogger("inflight.vllm.worker")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
NONFINITE = "NaN or Inf values in"  # the receiver answers 400 for an error that says this

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupNCCL


class InflightWorkerExtension:
    """Methods named `inflight_*` to avoid clashing with vLLM's own Worker methods."""

    # what an update puts aside until inflight_apply (set on the worker as it stages; absent before)
    _inflight_staged: dict[str, torch.Tensor]
    _inflight_staged_bases: tuple[str, ...] | None  # an adapter's merged bases; None for a full update

    # ---- model facts ------------------------------------------------------------------------------------------
    def inflight_model_info(self) -> dict[str, Any]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        return {"dtype": DTYPE_NAMES.get(dtype, str(dtype)), "device": str(next(model.parameters()).device.type),
                "tied": bool(getattr(hf, "tie_word_embeddings", False)),
                "rank": int(self.rank)}  # type: ignore[attr-defined]

    # ---- process group (joined in a thread, so the engine keeps generating while the trainer gathers ranks) ----
    def inflight_join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            backend: str, timeout_s: float) -> int:
        rank = rank_offset + int(self.rank)  # type: ignore[attr-defined]  # several workers: consecutive ranks
        # a newer join supersedes this one: its thread then neither builds a group nor reports a state
        seq = self._inflight_join_seq = getattr(self, "_inflight_join_seq", 0) + 1
        self._inflight_group_state = "pending"
        self._inflight_group = None
        device = self._inflight_device()

        def current() -> bool:
            return self._inflight_join_seq == seq

        def join() -> None:
            group: ProcessGroupGloo | ProcessGroupNCCL
            try:
                if device.type == "cuda":  # this thread started on device 0; NCCL binds the current one
                    torch.cuda.set_device(device)
                timeout = datetime.timedelta(seconds=timeout_s)
                store = TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
                if not current():
                    return
                if backend == "gloo":
                    group = ProcessGroupGloo(store, rank, world_size, timeout)
                else:
                    from torch.distributed import ProcessGroupNCCL  # lazy: only in CUDA builds of torch

                    opts = ProcessGroupNCCL.Options()
                    opts._timeout = timeout
                    group = ProcessGroupNCCL(store, rank, world_size, opts)
                if current():
                    self._inflight_group = group
                    self._inflight_group_state = "ready"
            except Exception as e:  # reported to the API process by inflight_group_status
                if current():
                    self._inflight_group_state = f"error: {type(e).__name__}: {e}"

        threading.Thread(target=join, name="inflight-join", daemon=True).start()
        return rank

    def inflight_group_status(self) -> str:
        return getattr(self, "_inflight_group_state", "none")

    def _inflight_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device  # type: ignore[attr-defined]

    # ---- staging ----------------------------------------------------------------------------------------------
    def inflight_receive(self, buckets: list[list[Any]], staging: str = "host") -> int:
        """One broadcast from rank 0 per bucket [[[name, shape, dtype, byte offset], ...], packed bytes], in order
        (the API process lays them out with inflight.contracts.bucket_layout): a bucket of one tensor arrives as
        that tensor (packed bytes 0), one of several as a flat uint8 buffer holding each at its offset."""
        group = getattr(self, "_inflight_group", None)
        if group is None:
            raise RuntimeError("no process group on this worker")
        device = self._inflight_device()
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        sizes = [packed or _nbytes(entries[0][1], entries[0][2]) for entries, packed in buckets]
        via_host = device.type == "cuda" and staging == "host"
        if via_host:  # one GPU buffer for every bucket, host buffers kept for the next update of this layout
            wire = torch.empty(max(sizes), dtype=torch.uint8, device=device)
            key = tuple(sizes)
            if getattr(self, "_inflight_host_key", None) != key:
                self._inflight_host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
                self._inflight_host_key = key
        staged, sums = {}, []
        for k, ((entries, packed), n) in enumerate(zip(buckets, sizes)):
            raw = wire[:n] if via_host else torch.empty(n, dtype=torch.uint8, device=device)
            lone = None if packed else _view(raw, 0, entries[0][1], entries[0][2])  # sent as that tensor
            group.broadcast([raw if packed else lone], opts).wait()
            if via_host:  # summed on the GPU (no sync), then copied out; the next broadcast follows in stream order
                sums += [_view(raw, off if packed else 0, shape, dt).sum(dtype=torch.float32)
                         for _, shape, dt, off in entries]
                self._inflight_host[k].copy_(raw, non_blocking=True)
                raw = self._inflight_host[k]
            for name, shape, dtype, offset in entries:
                staged[name] = _view(raw, offset if packed else 0, shape, dtype)
        finite = None
        if via_host:
            torch.cuda.current_stream(device).synchronize()
            finite = not sums or bool(torch.isfinite(torch.stack(sums).sum()))  # one sync for the whole update
        self._inflight_stage(staged, finite=finite)
        return len(staged)

    def inflight_stage_file(self, path: str) -> int:
        self._inflight_stage(load_file(path, device="cpu"))
        return len(self._inflight_staged)

    def inflight_stage_shm(self, path: str, entries: list[list[Any]]) -> int:
        """Views [name, shape, dtype, data offset] of the trainer's shared-memory segment (checked by the API
        process: header, version, announcement digest); the mapping is kept while the trainer reuses the file."""
        mapping = getattr(self, "_inflight_shm", None)
        if mapping is None:
            mapping = self._inflight_shm = ShmMapping()
        views = mapping.tensors(path, [tuple(e) for e in entries])
        # copied once, checked while copied: the trainer can still write the segment, so it is never read again
        copies, bad = private_copies(views)
        self._inflight_stage(copies, finite=not bad)
        return len(self._inflight_staged)

    def _inflight_stage(self, staged: dict[str, torch.Tensor], finite: bool | None = None) -> None:
        """Keep `staged` for inflight_apply once it is finite (`finite`: already checked on the way in). On a GPU
        they may be views of memory later updates reuse (the host buffers): the apply copies them into
        the model; on CPU they are the worker's own (the shadow checkpoint keeps them)."""
        self._inflight_staged, self._inflight_staged_bases = {}, None
        bad = [] if finite else nonfinite(staged)
        if bad:
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise ValueError(f"weight update rejected: {NONFINITE} {bad[:5]}{more}; nothing applied")
        self._inflight_staged = staged

    def inflight_drop_staged(self) -> None:
        self._inflight_staged, self._inflight_staged_bases = {}, None

    # ---- adapters -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def inflight_merge_staged(self, scaling: float) -> int:
        """Replace the staged adapter (<base>.lora_A / .lora_B) by the merged weights of its bases, plus W0 for the
        bases of the served adapter it does not list (GPU; on CPU the shadow is W0 already)."""
        staged: dict[str, torch.Tensor] = getattr(self, "_inflight_staged", {})
        bases = bases_of(staged)
        device = self._inflight_device()
        merged = {b: merge(self._inflight_w0(b).to(device), staged[b + LORA_A], staged[b + LORA_B], scaling)
                  for b in bases}
        bad = nonfinite(merged)  # finite A and B can still overflow W0 + s * B @ A
        if bad:
            self._inflight_staged, self._inflight_staged_bases = {}, None
            raise ValueError(f"weight update rejected: {NONFINITE} the merged weights W0 + scaling * B @ A of "
                             f"{bad[:5]}; nothing applied")
        if device.type != "cpu":
            for b in getattr(self, "_inflight_adapted", ()):
                merged.setdefault(b, self._inflight_w0(b))
        self._inflight_staged, self._inflight_staged_bases = merged, tuple(bases)
        return len(merged)

    def _inflight_w0(self, base: str) -> torch.Tensor:
        if self._inflight_device().type == "cpu":
            return self._inflight_shadow_checkpoint()[base]
        w0 = self.__dict__.setdefault("_inflight_w0_store", {})
        if base not in w0:
            if base in getattr(self, "_inflight_replaced", set()):
                raise RuntimeError(f"weight update rejected: the base weight {base!r} was replaced by a full update "
                                   "that this GPU worker kept no copy of; start the server from a checkpoint "
                                   "holding it to adapt it")
            w0[base] = _read_tensor(self.vllm_config.model_config.model, base)  # type: ignore[attr-defined]
        return w0[base]

    def _inflight_shadow_checkpoint(self) -> dict[str, torch.Tensor]:
        shadow = getattr(self, "_inflight_shadow", None)
        if shadow is None:
            shadow = self._inflight_shadow = _read_checkpoint(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        return shadow

    # ---- apply ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def inflight_apply(self) -> float:
        """Load the staged tensors (HF checkpoint names) into the model; vLLM fuses / shards them itself."""
        t0 = time.perf_counter()
        staged: dict[str, torch.Tensor] = getattr(self, "_inflight_staged", {})
        if not staged:
            raise RuntimeError("nothing staged")
        adapter = getattr(self, "_inflight_staged_bases", None)  # None: a full update
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if next(model.parameters()).device.type == "cpu":
            self._inflight_apply_cpu(staged, adapter is not None)
        else:
            if adapter is None:  # the adapter is dropped: its bases are W0 again unless this update names them
                w0 = self.__dict__.setdefault("_inflight_w0_store", {})
                for b in getattr(self, "_inflight_adapted", ()):
                    if b not in staged:
                        staged = {**staged, b: w0[b]}
                for name, t in staged.items():
                    if name in w0:  # the new base weights of a base adapters touched: kept (small)
                        w0[name] = t.to("cpu", copy=True)
                    else:
                        self.__dict__.setdefault("_inflight_replaced", set()).add(name)
            model.load_weights(staged.items())  # in place (host tensors: copied to the GPU); a subset is fine
        self._inflight_adapted = adapter or ()
        self._inflight_staged, self._inflight_staged_bases = {}, None
        return time.perf_counter() - t0

    def _inflight_apply_cpu(self, staged: dict[str, torch.Tensor], adapter: bool = False) -> None:
        """vLLM's CPU linears are prepacked, so a plain `load_weights` does not reach the kernels: reload the
        whole model through vLLM's layerwise reload. A partial update is merged into a shadow copy of the full
        checkpoint first (a reload with missing tensors would leave layers on the meta device). The shadow holds
        the base weights: an adapter's merged weights are loaded over it, never written into it."""
        shadow = self._inflight_shadow_checkpoint()
        if adapter:
            weights = {**shadow, **staged}
        else:
            for name, t in staged.items():
                shadow[name] = t.to("cpu")
            weights = shadow
        self.model_runner.reload_weights(weights_iterator=iter(list(weights.items())))  # type: ignore[attr-defined]
        hf = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        if getattr(hf, "tie_word_embeddings", False):  # the prepacked lm_head would keep the OLD weights
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # lazy: vLLM's CPU path only

            dispatch_cpu_unquantized_gemm(self.model_runner.get_model().lm_head, remove_weight=False)  # type: ignore[attr-defined]


def _nbytes(shape: list[int], dtype: str) -> int:
    return DTYPES[dtype].itemsize * math.prod(shape)


def _view(buf: torch.Tensor, offset: int, shape: list[int], dtype: str) -> torch.Tensor:
    return buf[offset: offset + _nbytes(shape, dtype)].view(DTYPES[dtype]).view(tuple(shape))


def _read_tensor(model_dir: str, name: str) -> torch.Tensor:
    """One tensor of the checkpoint (read alone, not the whole file)."""
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise RuntimeError(f"{name!r} is not in the checkpoint {model_dir}")


def _read_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise RuntimeError(f"no *.safetensors in {model_dir}: partial updates on CPU need the original checkpoint")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f, device="cpu"))
    return out
