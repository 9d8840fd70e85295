"""Fast forward for the llama / qwen2 family over an engine-managed slot KV cache.

It reads the HF module's own parameters. q/k/v and gate/up are fused into one matrix each for speed, and the HF
parameters are then re-pointed to views of the fused storage, so they remain the SAME memory: an in-place copy
into an HF parameter (what `load_weights` does) updates this forward too, and nothing is duplicated.

KV cache: one tensor [layers, 2 (k, v), max_batch, kv_heads, max_model_len, head_dim]; a sequence owns one slot,
and one index_copy_ per layer writes the step's k and v. Decoding sequences attend in one batched matmul over the
first max(live length) positions only (a view when their slots are consecutive, else a gather), masked past each
length; prefill chunks attend one sequence at a time with a causal mask offset by the cached prefix.

Measured on CPU, fp32, 1 thread (why it looks like this): at batch 128 the matmuls are ~30% of an unfused step;
the rest was per-op overhead. Fusions here (rms_norm, rope in place with a signed sin table, k/v written by one
index_copy_, mask+scale folded into baddbmm, residual folded into addmm) each remove one or more full passes.
On CPU in float32 the norms, rope + KV write, the gated activation and (with one thread) the attention run as C
kernels instead (cpu_kernels.py: one pass each; the attention of every token of the step, decodes and prompt
chunks alike, is one call that reads only each token's own cached prefix, straight from its slot); the torch ops
above remain the path everywhere else and the reference in the tests.

Precision (precision.py): the HF parameters stay the master copy; `self.gen` holds the weights the forward
computes with (in float32 the master tensors, the large ones also pre-packed for oneDNN on CPU; bf16 copies or
int8-packed matrices otherwise), rebuilt from the master once on load and once per weight update
(after_weight_update, inside the engine's pause). INFLIGHT_PACK_WEIGHTS=0 turns the float32 packing off.
In float32 with packing, an update does not re-pack inside the pause (re-packing a 538 MB model cost 2-7x the copy
of its bytes, and the pause answers the push): the pause points the generator at the new master tensors, correct at
once and only unpacked (10-20% slower matmuls), and a background thread re-packs them; the packed weights are swapped
in at the next step boundary, unless another update came meanwhile (then they are dropped and re-packed again).

Staged updates (CPU, `double_buffer`): a full shared-memory update is copied by `stage()` into spare storage while
the engine generates (each fused matrix, the embedding, an untied head), checked for NaN/Inf in the same pass, each
part as soon as the trainer has written it to the segment (the two copies of a push overlap), and the pause only re-points the forward and the HF parameters at it (`swap()`); the storage let go becomes the next
update's spare. It costs one more copy of the model in memory; INFLIGHT_STAGE_UPDATES=0 turns it off. The forward
never computes from a segment itself: its writer can still change it (what was checked must be what is
served), so every block is copied once.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from inflight.transport import finite
from inflight.engine.model import cpu_kernels
from inflight.engine.model import precision as prec
from inflight.engine.scheduler.step import StepPlan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUPPORTED_TYPES = ("llama", "qwen2")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin do not depend on the sequence length
STAGE_CHUNK_BYTES = 4 << 20  # stage() following a segment being written copies this much at a time


def supports(model: PreTrainedModel) -> str | None:
    """None if the fast path can run this model, else the reason it cannot."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {SUPPORTED_TYPES}"
    rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} depends on the sequence length"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "mlp bias"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "the output layer is not an nn.Linear"
    return None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dim; re-point each to its view."""
    w = torch.cat([l.weight.data for l in linears], 0).contiguous()
    has_bias = [l.bias is not None for l in linears]
    b = None
    if any(has_bias):
        b = torch.cat([l.bias.data if l.bias is not None else w.new_zeros(l.out_features) for l in linears])
    row = 0
    for l in linears:
        n = l.out_features
        l.weight.data = w[row : row + n]
        if l.bias is not None and b is not None:  # b is set when any member has a bias
            l.bias.data = b[row : row + n]
        row += n
    return w, b


class LlamaRunner:
    def __init__(self, model: PreTrainedModel, max_batch: int, max_model_len: int, precision: str = "float32",
                 pack: bool | None = None, kernels: bool = True):
        cfg = model.config
        self.pack = os.environ.get("INFLIGHT_PACK_WEIGHTS", "1") != "0" if pack is None else pack
        self.model = model
        p = next(model.parameters())
        prec.check_precision(precision, p.device)
        self.precision = precision
        self.device, self.dtype = p.device, prec.compute_dtype(precision, p.dtype)
        self.n_heads: int = cfg.num_attention_heads
        self.n_kv: int = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden: int = cfg.hidden_size
        self.eps: float = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # the HF decoder (LlamaModel / Qwen2Model, no common base class): its submodules are read by name
        self.inner: Any = model.model
        lm_head = model.lm_head
        assert isinstance(lm_head, torch.nn.Linear), "llama / qwen2 output layers are nn.Linear"
        self.lm_head = lm_head
        # per layer: the master tensors by key (see prec.GeneratorWeights), and "inter" (the MLP's width)
        self.layers: list[dict[str, Any]] = []
        # (layer, key of self.layers[layer]) -> [(HF parameter, first row, end row)]: what swap() re-points
        self.members: dict[tuple[int, str], list[tuple[torch.Tensor, int, int]]] = {}
        for li, layer in enumerate(self.inner.layers):
            at, mlp = layer.self_attn, layer.mlp
            for key, linears in (("w_qkv", [at.q_proj, at.k_proj, at.v_proj]), ("w_gu", [mlp.gate_proj, mlp.up_proj]),
                                 ("wo", [at.o_proj]), ("wd", [mlp.down_proj])):
                ends = torch.tensor([l.out_features for l in linears]).cumsum(0).tolist()
                self.members[(li, key)] = [(l.weight, e - l.out_features, e) for l, e in zip(linears, ends)]
            w_qkv, b_qkv = _fuse([at.q_proj, at.k_proj, at.v_proj])
            w_gu, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, w_qkv=w_qkv, b_qkv=b_qkv, wo=at.o_proj.weight, bo=at.o_proj.bias,
                ln2=layer.post_attention_layernorm.weight, w_gu=w_gu, wd=mlp.down_proj.weight,
                inter=mlp.gate_proj.out_features,
            ))
        # the embedding and an untied output layer: one "block" each (layer -1), their Parameter re-pointed by swap()
        embed, head = self.inner.embed_tokens.weight, self.lm_head.weight
        self.members[(-1, "embed")] = [(embed, 0, embed.shape[0])]
        if head is not embed:
            self.members[(-1, "head")] = [(head, 0, head.shape[0])]
        # staged updates (stage()): on CPU the storage a swap() replaced is kept and written by the next update, so
        # a full update is copied while the engine generates and the pause only re-points (one more model copy
        # of memory; on a GPU the memory is dearer and updates are copied in the pause as before)
        self.double_buffer = self.device.type == "cpu" and os.environ.get("INFLIGHT_STAGE_UPDATES", "1") != "0"
        self._spares: dict[tuple[int, str], torch.Tensor] = {}
        if self.double_buffer:  # the loaded weights are a private mapping of the checkpoint file (safetensors):
            # the first write into a page copies it from the file (measured: the second staged update of a 538 MB
            # model, into that storage, took as long as the first into fresh memory); the fused ones are copies
            for (li, key), ms in self.members.items():
                if li < 0 or key in ("wo", "wd"):
                    ms[0][0].data = ms[0][0].data.clone()
        lib = cpu_kernels.load() if kernels and self.double_buffer else None
        self._copier = cpu_kernels.Kernels(lib) if lib is not None else None  # copy + NaN/Inf count in one pass
        # rope table for every position, from the HF module itself (so rope scaling matches exactly);
        # sin carries rotate_half's sign, so rope(x) = x * cos + cat(x2, x1) * sin_signed
        pos = torch.arange(max_model_len, device=self.device)[None]
        cos, sin = self.inner.rotary_emb(torch.zeros(1, device=self.device, dtype=p.dtype), pos)
        half = self.head_dim // 2
        self.cos = cos[0].to(self.dtype).contiguous()  # [max_model_len, head_dim]
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1).to(self.dtype).contiguous()
        # one tensor for k and v, so one index_copy_ per layer writes both: [layers, 2, slots, kv_heads, len, dim]
        self.max_batch, self.max_len = max_batch, max_model_len
        shape = (len(self.layers), 2, max_batch, self.n_kv, max_model_len, self.head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_cache, self.v_cache = self.kv[:, 0], self.kv[:, 1]
        # float32 on CPU: norms, rope + KV write, silu * up and decode attention in C (cpu_kernels.py), else torch ops
        use_c = kernels and cpu_kernels.usable(self.device, self.dtype, self.head_dim)
        c_lib = cpu_kernels.load() if use_c else None
        self.kernels = cpu_kernels.Kernels(c_lib) if c_lib is not None else None
        self.weight_builds = 0  # how many times the generator's weights were derived (1 + one per update)
        self.pinned = False  # pin_storage(): weights and KV never move (CUDA graphs hold their addresses)
        self._repacker: _Repacker | None = None  # float32 packing after an update, off the engine thread
        self.gen: prec.GeneratorWeights  # what the forward computes with, derived below
        self.after_weight_update()

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:  # only ever set for a float32 forward
            return self.kernels.rms_norm(x, w, self.eps)
        if x.dtype == torch.float32:  # fused; bit-identical to HF's LlamaRMSNorm in float32
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    def reset_slot(self, slot: int) -> None:
        pass  # positions are always rewritten before they are read

    def after_weight_update(self) -> None:
        """The fused tensors are the HF parameters' storage; derive the generator's weights from them again (a tied
        head is the embedding's tensor, so it follows). Packing after an update is left to the background."""
        embed, norm, head = self.inner.embed_tokens.weight, self.inner.norm.weight, self.lm_head
        self.weight_builds += 1
        if self.pinned and prec.refresh(self.gen, self.precision, embed, self.layers, norm, head.weight, head.bias):
            return  # in place: every tensor keeps the address a captured CUDA graph reads
        defer = (self.weight_builds > 1 and self.pack and self.precision == "float32"
                 and prec.packing_available(self.device))
        build = functools.partial(prec.build, self.precision, embed, self.layers, norm, head.weight, head.bias)
        self.gen = build(pack=self.pack and not defer)
        if defer:
            if self._repacker is None:
                self._repacker = _Repacker()
            self._repacker.request(self.weight_builds, functools.partial(build, pack=True))

    def _blocks(self, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """{block: {id(HF parameter): (name, tensor)}} for the tensors that a block's storage holds, and the rest."""
        by_param = {id(p): where for where, ms in self.members.items() for p, _, _ in ms}
        touched: dict[tuple[int, str], dict[int, tuple[str, torch.Tensor]]] = {}
        rest = {}
        params = dict(self.model.named_parameters())
        for name, t in tensors.items():
            p = params.get(name)
            if p is None or id(p) not in by_param:
                rest[name] = t
            else:
                touched.setdefault(by_param[id(p)], {})[id(p)] = (name, t)
        return touched, rest

    def _storage(self, where: tuple[int, str]) -> torch.Tensor:
        """The block's storage as a plain tensor (o_proj / down_proj start as the HF Parameter itself, whose .data
        a swap re-points: a reference to the Parameter would follow it to the new storage)."""
        li, key = where
        return (self.layers[li][key] if li >= 0 else self.members[where][0][0]).data

    def prepare_swap(self, tensors: dict[str, torch.Tensor]) -> tuple[list, dict[str, torch.Tensor]]:
        """Off the engine thread: new storage for every block matrix that `tensors` (HF names) touch, fused as the
        forward reads it (a fused q|k|v or gate|up takes its untouched members from the current weights), and the
        tensors no block matrix holds (to be copied in by load_weights). Reads the weights, changes nothing."""
        touched, rest = self._blocks(tensors)
        prepared = []
        with torch.no_grad():
            for where, new_rows in touched.items():
                cur = self._storage(where)
                new = torch.empty_like(cur, memory_format=torch.contiguous_format)
                for p, a, b in self.members[where]:
                    # a private copy: W0 tensors are never aliased
                    new[a:b].copy_(new_rows[id(p)][1] if id(p) in new_rows else cur[a:b])
                prepared.append((where, new))
        return prepared, rest

    def stage(self, tensors: dict[str, torch.Tensor], check_finite: bool = True,
              ready=None) -> tuple[list, dict, list[str]]:
        """Off the engine thread, a full update (`tensors`: HF names, the model's dtypes): as prepare_swap, but
        written into the storage the previous swap() let go (no fresh pages: faulting in 538 MB cost more than
        copying it), and checked for NaN/Inf as it is copied, in one pass (the C kernel for float32, else
        finite.copy_summed: chunks summed while in cache). `ready(view)`, if given, waits until a chunk of rows of
        a tensor is there to be read (a shared-memory segment the trainer is still writing: SegmentWatch.ready);
        the tensors are then copied a few MB at a time, in the order the trainer writes them. Returns (prepared
        for swap(), the tensors left to load_weights, names of the staged tensors holding NaN/Inf: then nothing
        may be swapped in). The engine never reads a spare: the weights it computes with do not change here. Each
        byte of `tensors` is read once: what was checked is what gets swapped in, whoever writes the source later."""
        touched, rest = self._blocks(tensors)
        prepared, bad, summed = [], [], []
        sums: list[torch.Tensor] = []
        with torch.no_grad():
            for where, new_rows in touched.items():
                cur = self._storage(where)
                spare = self._spares.get(where)
                if (spare is None or spare.shape != cur.shape or spare.dtype != cur.dtype
                        or spare.data_ptr() == cur.data_ptr()):
                    spare = self._spares[where] = torch.empty_like(cur, memory_format=torch.contiguous_format)
                for p, a, b in self.members[where]:
                    if id(p) not in new_rows:
                        spare[a:b].copy_(cur[a:b])  # a partial update: the member keeps its current value
                        continue
                    name, whole = new_rows[id(p)]
                    r = 0
                    for t in self._chunks(whole, ready):
                        dst, r = spare[a + r: a + r + t.shape[0]], r + t.shape[0]
                        if not check_finite:
                            dst.copy_(t)
                        elif (self._copier is not None and t.dtype == dst.dtype == torch.float32
                              and t.device.type == "cpu" and t.is_contiguous() and dst.is_contiguous()):
                            if not self._copier.copy_finite(dst, t) and name not in bad:
                                bad.append(name)
                        else:
                            finite.copy_summed(dst, t, sums)
                            summed.append((name, dst))
                prepared.append((where, spare))
        if not finite.finite_sums(sums):  # or huge finite values overflowed the sum: look at each chunk
            bad += [n for n in dict.fromkeys(n for n, v in summed if not bool(torch.isfinite(v).all())) if n not in bad]
        return prepared, rest, bad

    @staticmethod
    def _chunks(whole: torch.Tensor, ready):
        """`whole` in chunks of rows, each once `ready` says the trainer has written it (all at once without)."""
        rows = whole.shape[0]
        step = max(1, rows if ready is None else STAGE_CHUNK_BYTES // max(1, whole[:1].numel() * whole.element_size()))
        for r in range(0, max(1, rows), step):
            t = whole[r: r + step]
            if ready is not None:
                ready(t)
            yield t

    def swap(self, prepared: list) -> None:
        """Inside the pause: point the forward and the HF parameters at the prepared storage (no copy); the caller
        then runs after_weight_update (load_weights does) so the generator's weights follow. With double_buffer
        the storage let go is kept as the block's spare: nothing reads it any more (the generator is rebuilt, a
        background re-pack of it is dropped as stale), so stage() may write it."""
        for where, new in prepared:
            old = self._storage(where)
            if self.pinned:  # copy into the storage the graphs read (prepare_swap's buffers are private copies)
                with torch.no_grad():
                    old.copy_(new)
                continue
            li, key = where
            if li >= 0:
                self.layers[li][key] = new
            for p, a, b in self.members[where]:
                p.data = new[a:b]  # still one storage per fused matrix: in-place updates keep reaching the forward
            if self.double_buffer:
                self._spares[where] = old

    def pin_storage(self) -> None:
        """From now on every weight tensor, generator copy and the KV cache keep their storage: updates are copied
        in place (swap() copies instead of re-pointing; no staging spare, no packed float32 copies, which a
        rebuild would replace), so a captured CUDA graph stays valid across weight updates."""
        self.pinned, self.double_buffer, self.pack = True, False, False
        self._spares.clear()
        self.gen = prec.build(self.precision, self.inner.embed_tokens.weight, self.layers, self.inner.norm.weight,
                              self.lm_head.weight, self.lm_head.bias, pack=False)

    def install_packed(self) -> bool:
        """At a step boundary: swap in the packed weights of the current master, if the background has them."""
        gen = self._repacker.take(self.weight_builds) if self._repacker is not None else None
        if gen is not None:
            self.gen = gen
        return gen is not None

    def _kv_index(self, plan: StepPlan) -> torch.Tensor:
        """Row of every (token, k|v, kv head) in a layer's cache viewed as [2 * slots * kv_heads * len, dim]."""
        KV, T = self.n_kv, self.max_len
        which = torch.arange(2 * KV, device=self.device)  # k heads then v heads, as in the qkv output
        base = ((which // KV) * self.max_batch * KV + which % KV) * T  # [2KV]
        return (base[None] + (plan.token_slots * KV * T + plan.positions)[:, None]).view(-1)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits [len(plan.out_rows), vocab] in float32."""
        if self._repacker is not None and self._repacker.ready:
            self.install_packed()
        n_tok, nd = plan.tokens.shape[0], plan.num_decode
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        rep = H // KV
        G, C = self.gen, self.kernels
        x = G.embed[plan.tokens]
        if C is None:
            cos = self.cos[plan.positions].unsqueeze(1)  # [N, 1, D], shared by all layers
            sin = self.sin[plan.positions].unsqueeze(1)
            kv_rows = self._kv_index(plan)
        T = plan.max_decode_len  # decodes attend only up to the longest one
        # the C attention is single-threaded; with more threads torch's batched matmuls use them all
        c_attn = C if torch.get_num_threads() == 1 else None  # every token over its plan.lens cached keys
        c_attention = c_attn is not None
        torch_prefills = () if c_attention else plan.prefills  # else one masked SDPA per chunk
        if nd and not c_attention:  # -inf past each sequence's length
            first = plan.decode_first_slot
            d_slots = plan.token_slots[:nd]
            d_mask = torch.zeros(nd, 1, T, dtype=self.dtype, device=self.device)
            d_mask.masked_fill_(torch.arange(T, device=self.device)[None] >= plan.lens[:nd, None, None], float("-inf"))
            d_mask = d_mask.repeat_interleave(KV, 0)  # [nd * KV, 1, T], broadcast over the rep query heads
        p_masks = []
        for slot, start, c, off in torch_prefills:
            qpos = torch.arange(start, start + c, device=self.device)[:, None]
            p_masks.append(torch.arange(start + c, device=self.device)[None] <= qpos)
        for li, L in enumerate(G.layers):
            h = self._norm(x, L["ln1"])
            qkv = prec.linear(h, L["w_qkv"], L["b_qkv"])
            cache = self.kv[li]
            kc, vc = cache[0], cache[1]
            qk = qkv[:, : (H + KV) * D].view(n_tok, H + KV, D)  # q and k, roped in place
            if C is not None:
                C.rope_and_cache(qkv, H, KV, D, self.cos, self.sin, plan.positions, plan.token_slots, kc, vc)
            else:
                rot = torch.cat((qk[..., D // 2 :], qk[..., : D // 2]), -1)
                torch.addcmul(qk * cos, rot, sin, out=qk)
                cache.view(-1, D).index_copy_(0, kv_rows, qkv[:, H * D :].reshape(-1, D))
            out = torch.empty(n_tok, H, D, dtype=x.dtype, device=self.device)
            if c_attn is not None:
                c_attn.cached_attention(qk[:, :H], kc, vc, plan.token_slots, plan.lens, plan.max_len, self.scale, out)
            elif nd:
                if first is not None:  # a view, no copy
                    kd, vd = kc[first : first + nd, :, :T], vc[first : first + nd, :, :T]
                else:
                    kd = kc[:, :, :T].index_select(0, d_slots)  # [nd, KV, T, D]; much faster than kc[d_slots]
                    vd = vc[:, :, :T].index_select(0, d_slots)
                qd = qkv[:nd, : H * D].reshape(nd * KV, rep, D)
                s = torch.baddbmm(d_mask, qd, kd.reshape(nd * KV, T, D).transpose(1, 2), alpha=self.scale)
                a = torch.softmax(s, dim=-1)
                torch.bmm(a, vd.reshape(nd * KV, T, D), out=out[:nd].view(nd * KV, rep, D))
            q = qk[:, :H]
            for (slot, start, c, off), m in zip(torch_prefills, p_masks):
                qp = q[off : off + c].transpose(0, 1).unsqueeze(0)  # [1, H, c, D]
                kp = kc[slot, :, : start + c].unsqueeze(0)
                vp = vc[slot, :, : start + c].unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=m, enable_gqa=rep > 1)
                out[off : off + c] = o[0].transpose(0, 1)
            x = prec.residual(x, out.view(n_tok, H * D), L["wo"], L["bo"])
            h = self._norm(x, L["ln2"])
            gu = prec.linear(h, L["w_gu"])
            if C is not None:
                act = C.silu_mul(gu)
            else:
                g, u = gu.split(L["inter"], dim=-1)
                act = F.silu(g).mul_(u)
            x = prec.residual(x, act, L["wd"], None)
        x = self._norm(x[plan.out_rows].to(G.head_dtype), G.norm)
        return prec.linear(x, G.head, G.head_bias).float()


class _Repacker:
    """One background thread that derives packed generator weights for the latest update. A result is taken only
    for the update it was built for: one built while a later update overwrote the master may be torn, and is
    dropped (the engine thread compares build numbers at the step boundary, after any such update's pause)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._want: tuple[int, Callable[[], prec.GeneratorWeights]] | None = None
        self._done: tuple[int, prec.GeneratorWeights] | None = None
        self.ready = False  # a result is waiting (read without the lock on every step)
        threading.Thread(target=self._run, name="weight-repack", daemon=True).start()

    def request(self, build: int, derive: Callable[[], prec.GeneratorWeights]) -> None:
        """derive(): the packed weights of update `build` (read from the master when it runs)."""
        with self._cv:
            self._want, self._done, self.ready = (build, derive), None, False
            self._cv.notify()

    def take(self, build: int) -> prec.GeneratorWeights | None:
        with self._cv:
            done, self._done, self.ready = self._done, None, False
        return done[1] if done is not None and done[0] == build else None

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._want is None:
                    self._cv.wait()
                (build, derive), self._want = self._want, None
            gen = derive()
            with self._cv:
                if self._want is None:  # no newer update asked meanwhile
                    self._done, self.ready = (build, gen), True
