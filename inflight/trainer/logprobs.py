"""Forward pass of a packed micro-batch and the per-token logprobs / entropy derived from it (shared by backends).

Packed attention: one row of T tokens holding several samples; attention never crosses samples.
- "inflight_packed" (CPU default, attention.py): causal SDPA per sample slice, boundaries from cu_seq_lens_q;
- "inflight_varlen" (GPU default, varlen.py): the same boundaries, one variable-length flash call per layer;
- "flash_attention_2" (GPU): no mask, varlen kernel, boundaries from the position_ids (restarting at 0 per sample);
- "sdpa" / "eager": an explicit block-diagonal causal 4D mask (transformers passes a 4D mask through as-is);
  correct for any architecture, but costs T^2 attention per row.
Samples of equal length (the common case of short RL answers cut at the same max_new_tokens, or one sample) skip
all of that: the row is reshaped to a [B, L] batch and run as a plain causal forward, no mask and no gathers.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from inflight.contracts import TrainBatch
from inflight.trainer import head
from inflight.trainer.kernels.attention import NAME as PACKED
from inflight.trainer.kernels.attention import packed_call
from inflight.trainer.head import CHUNK_ELEMS
from inflight.trainer.prefix import shared_layout
from inflight.trainer.kernels.varlen import NAME as VARLEN

OURS = (PACKED, VARLEN)  # attentions that take the sample boundaries and the shared-prompt layout


def block_causal_mask(sample_index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[1, 1, T, T] mask: query i sees key j iff same sample and j <= i. Bool (True = attend), or additive float
    (0 / -inf-like) when `dtype` is given (eager attention adds the mask to the scores)."""
    t = sample_index.shape[0]
    same = sample_index[:, None] == sample_index[None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=sample_index.device).tril()
    allowed = (same & causal)[None, None]
    if dtype is None:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=sample_index.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def uniform(batch: TrainBatch) -> bool:
    """All samples of the micro-batch have one length and positions 0..L-1 (what collate builds)."""
    lens = batch.seq_lens
    return len(lens) > 0 and min(lens) == max(lens) and sum(lens) == batch.input_ids.shape[0]


def _plan(model: torch.nn.Module, batch: TrainBatch, device: torch.device | str, share_prompts: bool
          ) -> tuple[dict, bool, torch.Tensor | None]:
    """How to run the micro-batch: the model's keyword arguments, whether inside `packed_call()`, and `back` (the
    output row of every packed token, None when the output rows are the packed tokens)."""
    lens = list(batch.seq_lens)
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl in OURS and share_prompts and (layout := shared_layout(batch, device)) is not None:
        return {"input_ids": layout.ids[None], "position_ids": layout.pos[None], "inflight_layout": layout}, True, \
            layout.back
    if uniform(batch):  # [B, L]: plain causal attention, no padding, no mask
        shape = (len(lens), lens[0])
        ids = batch.input_ids.to(device).view(shape)
        return {"input_ids": ids, "position_ids": batch.position_ids.to(device).view(shape)}, False, None
    ids = batch.input_ids.to(device)[None]
    pos = batch.position_ids.to(device)[None]
    if impl in OURS:
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(device, torch.int32)
        return {"input_ids": ids, "position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": max(lens), "max_length_k": max(lens)}, True, None
    if "flash" in impl:
        mask = None  # varlen: sequence boundaries from position_ids
    elif impl == "eager":
        mask = block_causal_mask(batch.sample_index.to(device), dtype=next(model.parameters()).dtype)
    else:
        mask = block_causal_mask(batch.sample_index.to(device))
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask}, False, None


def _forward(model: torch.nn.Module, kwargs: dict, packed: bool) -> torch.Tensor:
    kwargs = {"attention_mask": None, **kwargs, "use_cache": False}
    with packed_call() if packed else contextlib.nullcontext():
        return model(**kwargs).logits


def packed_logits(model: torch.nn.Module, batch: TrainBatch, device: torch.device | str,
                  share_prompts: bool = True) -> torch.Tensor:
    """Logits [T, V] of one packed micro-batch. With "inflight_packed" attention and `share_prompts`, samples with
    the same prompt run it once (prefix.py); the logits come back in the packed layout either way."""
    kwargs, packed, back = _plan(model, batch, device, share_prompts)
    logits = _forward(model, kwargs, packed)
    logits = logits.reshape(-1, logits.shape[-1])
    return logits if back is None else logits.index_select(0, back)


def packed_token_logprobs(model: torch.nn.Module, batch: TrainBatch, device: torch.device | str,
                          share_prompts: bool = True, need_entropy: bool = False, chunk_elems: int = CHUNK_ELEMS,
                          trained_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of the micro-batch under the model. With the chunked head installed (head.py) they come
    from the final hidden states a chunk of tokens at a time, and no [T, V] logits exist; otherwise from the
    model's logits. Call it inside the trainer's autocast: the head runs in autocast's dtype.
    `trained_only`: with the chunked head, only the tokens the loss trains (batch.loss_mask > 0) go through the
    head, the rest are 0: a group's prompt predicts its own tokens once per sample, and those rows are most of
    the head's work (SmolLM2's 49k-vocabulary head on the real demo's steps: ~4.8x the rows it needs)."""
    if not head.installed(model):
        logits = packed_logits(model, batch, device, share_prompts)
        with torch.autocast(torch.device(device).type, enabled=False):  # float32 from the logits, as always
            return token_logprobs(logits, batch, need_entropy, chunk_elems)
    kwargs, packed, back = _plan(model, batch, device, share_prompts)
    n = batch.input_ids.shape[0]
    pos = batch.position_ids
    predicted = pos != 0  # tokens something predicts: not a sample's first (position 0)
    predicted[:1] = False
    if trained_only:  # none trained: an empty request, which still keeps the head and the body in the graph
        predicted &= batch.loss_mask > 0
    tokens = torch.nonzero(predicted)[:, 0]
    rows = tokens - 1
    rows = rows.to(device) if back is None else back.index_select(0, rows.to(back.device))
    request = head.HeadRequest(rows.to(device), batch.input_ids[tokens].to(device), batch.temperature, need_entropy,
                               chunk_elems)
    with head.head_request(request):
        out = _forward(model, kwargs, packed)
    tokens = tokens.to(out.device)
    lp = torch.zeros(n, dtype=out.dtype, device=out.device).index_copy(0, tokens, out[:, 0])
    ent = None
    if need_entropy:
        ent = torch.zeros(n, dtype=out.dtype, device=out.device).index_copy(0, tokens, out[:, 1])
    return lp, ent


def token_logprobs(
    logits: torch.Tensor, batch: TrainBatch, need_entropy: bool = False, chunk_elems: int = CHUNK_ELEMS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logprob[t] = log softmax(logits[t-1] / temperature)[input_ids[t]], 0 on each sample's first token
    (nothing predicts it); entropy[t] the entropy of that same distribution. Computed in float32 at least (bf16
    logits are upcast; a float64 model stays float64), a chunk of rows at a time: the upcast copy of all [T, V]
    logits (16k tokens x 152k vocabulary: 10 GB) never exists. With gradients each chunk is recomputed in backward
    (checkpoint), so autograd keeps no float32 copy either."""
    ids = batch.input_ids.to(logits.device)
    first = batch.position_ids.to(logits.device) == 0
    rows = max(1, chunk_elems // max(1, logits.shape[-1]))
    grad = torch.is_grad_enabled() and logits.requires_grad
    lps, ents = [], []
    for a in range(0, max(1, logits.shape[0] - 1), rows):  # one token: an empty chunk keeps the autograd graph
        b = min(a + rows, logits.shape[0] - 1)
        args = (logits[a:b], ids[a + 1:b + 1], batch.temperature, need_entropy)
        if grad and rows < logits.shape[0] - 1:
            lp, e = checkpoint(_rows_logprobs, *args, use_reentrant=False)
        else:
            lp, e = _rows_logprobs(*args)
        lps.append(lp)
        ents.append(e)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    lp = torch.cat([torch.zeros(1, dtype=dtype, device=logits.device), *lps])
    lp = torch.where(first, torch.zeros_like(lp), lp)
    ent = None
    if need_entropy:
        e = torch.cat([torch.zeros(1, dtype=dtype, device=logits.device), *ents])
        ent = torch.where(first, torch.zeros_like(lp), e)
    return lp, ent


def _rows_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, temperature: float, need_entropy: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of next_ids[i] (and the entropy) under row i of the logits, in float32 at least."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, next_ids[:, None])[:, 0] - lse
    if not need_entropy:
        return lp, None
    return lp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)
