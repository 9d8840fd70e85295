"""Runs INSIDE each vLLM worker (`--worker-extension-cls inflight.engine.vllm_backend.worker_ext.InflightWorkerExtension`):
vLLM mixes these methods into its Worker class, and the API process calls them with `collective_rpc(name, ...)`.

The worker, not the API process, joins the trainer's process group and receives the broadcasts (on a GPU the
tensors land straight in GPU memory; nothing goes through the API process). An update happens in two calls:
`inflight_receive` / `inflight_stage_file` put the new tensors in fresh buffers ("staged"), `inflight_apply` swaps
them in with one load, so the model is never half-updated.

Only torch, safetensors and vLLM are imported here: this module runs in vLLM's environment.
"""

from __future__ import annotations

import datetime
import glob
import logging
import math
import os
import threading
import time
from typing import Any

import torch

log = logging.getLogger("inflight.vllm.worker")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class InflightWorkerExtension:
    """Methods named `inflight_*` to avoid clashing with vLLM's own Worker methods."""

    # ---- model facts ------------------------------------------------------------------------------------------
    def inflight_model_info(self) -> dict[str, Any]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        return {"dtype": DTYPE_NAMES.get(dtype, str(dtype)), "device": str(next(model.parameters()).device.type),
                "tied": bool(getattr(hf, "tie_word_embeddings", False)), "rank": int(self.rank)}  # type: ignore[attr-defined]

    # ---- process group (joined in a thread, so the engine keeps generating while the trainer gathers ranks) ----
    def inflight_join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            backend: str, timeout_s: float) -> int:
        rank = rank_offset + int(self.rank)  # type: ignore[attr-defined]  # several workers: consecutive ranks
        self._inflight_group_state = "pending"
        self._inflight_group = None

        def join() -> None:
            from torch.distributed import ProcessGroupGloo, TCPStore

            try:
                timeout = datetime.timedelta(seconds=timeout_s)
                store = TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
                if backend == "gloo":
                    group = ProcessGroupGloo(store, rank, world_size, timeout)
                else:
                    from torch.distributed import ProcessGroupNCCL

                    opts = ProcessGroupNCCL.Options()
                    opts._timeout = timeout
                    group = ProcessGroupNCCL(store, rank, world_size, opts)
                self._inflight_group = group
                self._inflight_group_state = "ready"
            except Exception as e:  # reported to the API process by inflight_group_status
                self._inflight_group_state = f"error: {type(e).__name__}: {e}"

        threading.Thread(target=join, name="inflight-join", daemon=True).start()
        return rank

    def inflight_group_status(self) -> str:
        return getattr(self, "_inflight_group_state", "none")

    # ---- staging ----------------------------------------------------------------------------------------------
    def inflight_receive(self, buckets: list[list[Any]]) -> int:
        """One broadcast from rank 0 per bucket [[[name, shape, dtype, byte offset], ...], packed bytes], in order
        (the API process lays them out with inflight.contracts.bucket_layout): a bucket of one tensor arrives as
        that tensor (packed bytes 0), one of several as a flat uint8 buffer holding each at its offset."""
        group = getattr(self, "_inflight_group", None)
        if group is None:
            raise RuntimeError("no process group on this worker")
        device = next(self.model_runner.get_model().parameters()).device  # type: ignore[attr-defined]
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        staged = {}
        for entries, packed in buckets:
            if not packed:
                (name, shape, dtype, _), = entries
                staged[name] = torch.empty(tuple(shape), dtype=DTYPES[dtype], device=device)
                group.broadcast([staged[name]], opts).wait()
                continue
            buf = torch.empty(packed, dtype=torch.uint8, device=device)
            group.broadcast([buf], opts).wait()
            for name, shape, dtype, offset in entries:
                n = DTYPES[dtype].itemsize * math.prod(shape)
                staged[name] = buf[offset: offset + n].view(DTYPES[dtype]).view(tuple(shape))
        self._inflight_staged = staged
        return len(staged)

    def inflight_stage_file(self, path: str) -> int:
        from safetensors.torch import load_file

        self._inflight_staged = load_file(path, device="cpu")
        return len(self._inflight_staged)

    def inflight_drop_staged(self) -> None:
        self._inflight_staged = {}

    # ---- apply ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def inflight_apply(self) -> float:
        """Load the staged tensors (HF checkpoint names) into the model; vLLM fuses / shards them itself."""
        t0 = time.perf_counter()
        staged: dict[str, torch.Tensor] = getattr(self, "_inflight_staged", {})
        if not staged:
            raise RuntimeError("nothing staged")
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if next(model.parameters()).device.type == "cpu":
            self._inflight_apply_cpu(staged)
        else:
            model.load_weights(staged.items())  # in place; a subset is fine
        self._inflight_staged = {}
        return time.perf_counter() - t0

    def _inflight_apply_cpu(self, staged: dict[str, torch.Tensor]) -> None:
        """vLLM's CPU linears are prepacked, so a plain `load_weights` does not reach the kernels: reload the
        whole model through vLLM's layerwise reload. A partial update is merged into a shadow copy of the full
        checkpoint first (a reload with missing tensors would leave layers on the meta device)."""
        shadow = getattr(self, "_inflight_shadow", None)
        if shadow is None:
            shadow = self._inflight_shadow = _read_checkpoint(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        for name, t in staged.items():
            shadow[name] = t.to("cpu")
        self.model_runner.reload_weights(weights_iterator=iter(list(shadow.items())))  # type: ignore[attr-defined]
        hf = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        if getattr(hf, "tie_word_embeddings", False):  # the prepacked lm_head would keep the OLD weights
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(self.model_runner.get_model().lm_head, remove_weight=False)  # type: ignore[attr-defined]


def _read_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise RuntimeError(f"no *.safetensors in {model_dir}: partial updates on CPU need the original checkpoint")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f, device="cpu"))
    return out
