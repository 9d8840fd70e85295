"""Decode steps through CUDA graphs (`cuda_graphs`): one graph per batch bucket, replayed every pure-decode step.

A decode step (every scheduled sequence feeds one token) of n sequences runs as the smallest bucket b >= n of
1, 2, 4, ..., max_batch. Each bucket's forward reads fixed input buffers (token, position, slot and length per row:
views of one [4, max_batch] tensor, filled from the host by one copy per step) and writes a fixed logits buffer.
Rows n..b-1 are padding: token 0 at position 0 of a scratch slot (one KV slot past the engine's, never given to a
sequence) with length 1, so they write and read only that slot, and their logits are never looked at.

The forward here has static shapes: nothing depends on host-side values, attention reads each row's length from
the lengths tensor (decode_attention.py: the Triton split kernel on CUDA, else the masked torch path). On CUDA each
bucket is captured once at start-up (warm-up on a side stream, then torch.cuda.graph into one shared memory pool)
and replayed; the graphs hold the addresses of the weights and the KV cache, so the runner is pinned first
(LlamaRunner.pin_storage: updates copy in place, never re-point). If anything in capture fails, or a captured graph
does not reproduce the eager forward on a check, the runner logs the error and decodes eagerly instead
(`status` says why); when the Triton attention was in use it first tries once more with the masked one.
Elsewhere (CPU) `capture=False` runs the same runner eagerly ("eager replay": same buckets, padding and buffers):
the tests check it against the plain forward there.
"""

from __future__ import annotations

import collections
import logging

import torch
import torch.nn.functional as F

from inflight.engine.model import decode_attention
from inflight.engine.model import precision as prec

log = logging.getLogger(__name__)

CHECK_ATOL = 1e-2  # captured vs eager logits on the start-up check (same kernels: only reduction order may differ)


def graphs_enabled(mode: str, device: torch.device, why_not: str | None) -> bool:
    """The `cuda_graphs` switch: auto = on for a CUDA device; on = also elsewhere (CPU: the same runner, run
    eagerly); why_not: why the fast llama path cannot run the model (None: it can)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs must be auto, on or off, not {mode!r}")
    if mode == "on" and why_not is not None:
        raise ValueError(f"cuda_graphs on needs the fast llama/qwen2 path: {why_not}")
    return why_not is None and (mode == "on" or (mode == "auto" and torch.device(device).type == "cuda"))


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, capture: bool, attention: str = "auto"):
        """runner: a LlamaRunner with one KV slot more than `max_batch` (the scratch slot, its last).
        attention: auto (Triton split kernel on CUDA when Triton is there, else masked) | split | masked."""
        if runner.max_batch < max_batch + 1:
            raise ValueError(f"the runner needs {max_batch + 1} KV slots (a scratch slot), has {runner.max_batch}")
        self.r, self.max_batch = runner, max_batch
        self.buckets = buckets(max_batch)
        self.scratch = runner.max_batch - 1
        dev = runner.device
        if attention == "auto":
            attention = "split" if dev.type == "cuda" and decode_attention.triton is not None else "masked"
        if attention == "split" and decode_attention.triton is None:
            raise ValueError("attention 'split' needs triton")
        self.attention = attention
        self._attend = decode_attention.split_attention if attention == "split" else decode_attention.masked_attention
        # rows: token, position, slot, length; padding everywhere until a step fills a prefix
        pad = torch.tensor([0, 0, self.scratch, 1], dtype=torch.long)[:, None].expand(4, max_batch).contiguous()
        self._pad = pad
        self.inputs = pad.to(dev, copy=True)  # never the padding itself (on CPU .to would return it)
        self._host = pad.clone().pin_memory() if dev.type == "cuda" else pad.clone()
        vocab = _rows(runner.gen.head)
        self.logits = {b: torch.zeros(b, vocab, dtype=torch.float32, device=dev) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays: collections.Counter = collections.Counter()  # bucket -> steps run through it
        self.status = "eager replay"
        if capture:
            self.capture()

    # ------------------------------------------------------------------ capture
    def capture(self) -> bool:
        """Capture every bucket; on any failure log why and stay eager. Returns whether graphs are in use."""
        try:
            try:
                self._capture()
                self._check()
            except Exception as e:  # noqa: BLE001 - the Triton kernel is the likeliest part to fail: once without
                if self.attention != "split":
                    raise
                log.error("CUDA graphs: capture with the Triton attention failed (%s: %s); trying the masked "
                          "attention (reads the whole cache)", type(e).__name__, e, exc_info=True)
                self.graphs.clear()
                self.attention, self._attend = "masked", decode_attention.masked_attention
                self._capture()
                self._check()
        except Exception as e:  # noqa: BLE001 - any failure means: do not use graphs, say why
            self.graphs.clear()
            self.logits = {b: torch.zeros_like(t) for b, t in self.logits.items()}
            self.status = f"eager (CUDA graph capture failed: {type(e).__name__}: {e})"
            log.error("CUDA graphs: capture failed, decoding eagerly instead (slower): %s: %s", type(e).__name__, e,
                      exc_info=True)
            return False
        self.status = f"captured {len(self.graphs)} graphs (buckets {self.buckets}, attention {self.attention})"
        log.info("CUDA graphs: %s", self.status)
        return True

    def _capture(self) -> None:
        if not torch.cuda.is_available() or self.r.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; the model is on {self.r.device}")
        with torch.cuda.device(self.r.device):  # the model's GPU, whichever is current
            self._capture_on_device()

    def _capture_on_device(self) -> None:
        side = torch.cuda.Stream(device=self.r.device)
        side.wait_stream(torch.cuda.current_stream(self.r.device))
        with torch.cuda.stream(side):  # compiles Triton kernels, picks cuBLAS algorithms, fills the allocator
            for b in self.buckets:
                for _ in range(2):
                    self._forward(b)
        torch.cuda.current_stream(self.r.device).wait_stream(side)
        torch.cuda.synchronize(self.r.device)
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool's memory
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[b] = self._forward(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(self.r.device)

    def _check(self) -> None:
        """Replay the smallest and largest graphs on the padding inputs and compare with the eager forward."""
        for b in {self.buckets[0], self.buckets[-1]}:
            with torch.cuda.device(self.r.device):
                self.graphs[b].replay()
            eager = self._forward(b)
            err = (self.logits[b] - eager).abs().max().item()
            if not err <= CHECK_ATOL:
                raise RuntimeError(f"bucket {b}: replayed logits differ from the eager forward by {err:.3g}")

    # ------------------------------------------------------------------ steps
    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} decodes > max_batch {self.max_batch}")

    def decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [n, vocab] (float32; a view of this bucket's buffer, valid until the next step)."""
        n = len(tokens)
        b = self.bucket(n)
        h = self._host
        h[:, :n] = torch.tensor([tokens, positions, slots, [p + 1 for p in positions]], dtype=torch.long)
        h[:, n:b] = self._pad[:, n:b]  # rows a larger step used before
        self.inputs.copy_(h, non_blocking=True)  # whole (contiguous, 32 bytes a row): one asynchronous copy
        g = self.graphs.get(b)
        if g is not None:
            with torch.cuda.device(self.r.device):  # replays on that device's current stream
                g.replay()
        else:
            self.logits[b].copy_(self._forward(b))
        self.replays[b] += 1
        return self.logits[b][:n]

    @torch.inference_mode()
    def _forward(self, b: int) -> torch.Tensor:
        """The decode forward of bucket b over the static inputs (static shapes, no host sync)."""
        r, G = self.r, self.r.gen
        tokens, positions, slots, lens = self.inputs[:, :b]
        H, KV, D = r.n_heads, r.n_kv, r.head_dim
        x = G.embed[tokens]
        cos = r.cos[positions].unsqueeze(1)  # [b, 1, D]
        sin = r.sin[positions].unsqueeze(1)
        which = torch.arange(2 * KV, device=r.device)  # k heads then v heads, as LlamaRunner._kv_index
        base = ((which // KV) * r.max_batch * KV + which % KV) * r.max_len
        kv_rows = (base[None] + (slots * KV * r.max_len + positions)[:, None]).view(-1)
        for li, L in enumerate(G.layers):
            h = r._norm(x, L["ln1"])
            qkv = prec.linear(h, L["w_qkv"], L["b_qkv"])
            cache = r.kv[li]
            qk = qkv[:, : (H + KV) * D].view(b, H + KV, D)
            rot = torch.cat((qk[..., D // 2:], qk[..., : D // 2]), -1)
            torch.addcmul(qk * cos, rot, sin, out=qk)
            cache.view(-1, D).index_copy_(0, kv_rows, qkv[:, H * D:].reshape(-1, D))
            out = self._attend(qk[:, :H], cache[0], cache[1], slots, lens, r.scale)
            x = prec.residual(x, out.reshape(b, H * D), L["wo"], L["bo"])
            h = r._norm(x, L["ln2"])
            g, u = prec.linear(h, L["w_gu"]).split(L["inter"], dim=-1)
            x = prec.residual(x, F.silu(g).mul_(u), L["wd"], None)
        x = r._norm(x.to(G.head_dtype), G.norm)
        return prec.linear(x, G.head, G.head_bias).float()


def _rows(w) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.out_features
