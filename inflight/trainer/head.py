"""Token logprobs and entropy straight from the final hidden states, a chunk of tokens at a time.

Why: the model's own head makes logits for every token, [T, V] (16k tokens x 152k vocabulary: 5 GB in bf16, and
as much again for their gradient), and the logprobs want them in float32 (10 GB). Here the head's matmul, the
float32 log-softmax and the entropy run per chunk of ~`chunk_elems / V` tokens, and the backward recomputes each
chunk's logits from the saved hidden states: no [T, V] tensor exists in either direction, only one chunk's
(CHUNK_ELEMS float32: 256 MB). The cost is the head's forward matmul once more in the backward.

`install(model)` swaps the forward of the output embedding (an `nn.Linear` without bias, on the instance only).
Outside `head_request(...)` it is the plain linear; inside, the model's forward returns, in place of logits,
[M, 1] logprobs (or [M, 2] logprobs and entropies) of the requested tokens: token m is predicted by hidden row
rows[m] (rows of the flattened [N, H] hidden states) and is targets[m]. Through the model's forward, so FSDP2's
hooks (unshard, mixed precision, gradient reduction) see it as the head's output. Compute dtype: autocast's when it
is on (bf16 matmuls, as autocast runs the head), else the weight's; the softmax is in float32 at least.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch

CHUNK_ELEMS = 1 << 26  # float32 logits per chunk (256 MB): ~440 tokens at a 152k vocabulary
# config attributes of models whose forward changes the head's logits (soft-capping, scaling): not chunked here
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class HeadRequest:
    rows: torch.Tensor  # [M] int64: the hidden row (flattened [N, H]) that predicts token m
    targets: torch.Tensor  # [M] int64: token m's id
    temperature: float
    need_entropy: bool
    chunk_elems: int = CHUNK_ELEMS


_REQUEST: contextvars.ContextVar[HeadRequest | None] = contextvars.ContextVar("inflight_head", default=None)


@contextlib.contextmanager
def head_request(request: HeadRequest) -> Iterator[None]:
    token = _REQUEST.set(request)
    try:
        yield
    finally:
        _REQUEST.reset(token)


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """A transformers model's head (None for a module without one)."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def supported(model: torch.nn.Module) -> str | None:
    """None when the chunked head applies to this model, else why not."""
    head = _output_embeddings(model)
    if type(head) is not torch.nn.Linear:
        return f"the output embedding is {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "the output embedding has a bias"
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"the model transforms its logits (config.{name})"
    return None


def install(model: torch.nn.Module) -> bool:
    """Swap in the chunked head's forward where `supported`; True when swapped."""
    head = _output_embeddings(model)
    if supported(model) is not None or head is None:
        return False
    head.forward = types.MethodType(_head_forward, head)
    head.inflight_chunked = True  # type: ignore[assignment]  # torch's stubs take Module.__setattr__ as tensors only
    return True


def installed(model: torch.nn.Module) -> bool:
    return bool(getattr(_output_embeddings(model), "inflight_chunked", False))


def _head_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    req = _REQUEST.get()
    if req is None:
        return type(self).forward(self, hidden)
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight = self.weight
    kind = flat.device.type
    if torch.is_autocast_enabled(kind):  # what autocast would run the head's linear in
        dtype = torch.get_autocast_dtype(kind)
        flat, weight = flat.to(dtype), weight.to(dtype)
    elif flat.dtype != weight.dtype:
        flat = flat.to(weight.dtype)
    lp, ent = head_logprobs(flat, weight, req.rows, req.targets, req.temperature, req.need_entropy,
                            req.chunk_elems)
    return torch.stack([lp, ent], -1) if req.need_entropy else lp[:, None]


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                  temperature: float, need_entropy: bool, chunk_elems: int = CHUNK_ELEMS
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """lp[m] = log softmax(hidden[rows[m]] @ weight.T / temperature)[targets[m]], ent[m] that distribution's entropy
    (an empty tensor when not `need_entropy`); float32 at least. Differentiable in hidden and weight."""
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden states are {hidden.dtype} but the head's weight is {weight.dtype}")
    chunk = max(1, int(chunk_elems) // max(1, weight.shape[0]))
    return _ChunkedHead.apply(hidden, weight, rows, targets, float(temperature), bool(need_entropy), chunk)


def _logits(hidden, weight, rows, a, b, acc, temperature):
    """Chunk [a, b): its hidden rows, and their logits / temperature in float32 at least (a fresh tensor)."""
    h = hidden.index_select(0, rows[a:b])
    z = h @ weight.T
    z = z.to(acc) if z.dtype != acc else z
    return h, z.div_(temperature)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, rows, targets, temperature: float, need_entropy: bool, chunk: int):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        m = rows.shape[0]
        lp = torch.empty(m, dtype=acc, device=hidden.device)
        lse = torch.empty(m, dtype=acc, device=hidden.device)
        ent = torch.empty(m if need_entropy else 0, dtype=acc, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, m, chunk):
                b = min(a + chunk, m)
                _, z = _logits(hidden, weight, rows, a, b, acc, temperature)
                lse[a:b] = torch.logsumexp(z, dim=-1)
                lp[a:b] = z.gather(1, targets[a:b, None])[:, 0] - lse[a:b]
                if need_entropy:  # H = lse - sum_k p_k z_k
                    p = (z - lse[a:b, None]).exp_()
                    ent[a:b] = lse[a:b] - torch.linalg.vecdot(p, z)
        ctx.save_for_backward(hidden, weight, rows, targets, lse, ent)
        ctx.temperature, ctx.need_entropy, ctx.chunk = temperature, need_entropy, chunk
        if not need_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, rows, targets, lse, ent = ctx.saved_tensors
        acc, t = lse.dtype, ctx.temperature
        want_hidden, want_weight = ctx.needs_input_grad[:2]  # a frozen head (LoRA): no [V, H] gradient at all
        d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if want_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, rows.shape[0], ctx.chunk):
                b = min(a + ctx.chunk, rows.shape[0])
                h, z = _logits(hidden, weight, rows, a, b, acc, t)
                p = (z - lse[a:b, None]).exp_()
                g = g_lp[a:b, None].to(acc)
                if ctx.need_entropy and g_ent is not None:
                    # dH/dz_k = -p_k (z_k - E_p[z]), E_p[z] = lse - H; dlp/dz_k = onehot_k - p_k
                    mean = (lse[a:b] - ent[a:b])[:, None]
                    coef = z.sub_(mean).mul_(g_ent[a:b, None].to(acc)).add_(g)
                else:
                    coef = g
                dz = p.mul_(coef).neg_()
                dz.scatter_add_(1, targets[a:b, None], g)
                dz = dz.div_(t).to(weight.dtype)
                if d_hidden is not None:
                    d_hidden.index_add_(0, rows[a:b], (dz @ weight).to(acc))
                if d_weight is not None:
                    d_weight += (dz.T @ h).to(acc)
        return (None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if d_weight is None else d_weight.to(weight.dtype), None, None, None, None, None)
