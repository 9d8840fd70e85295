"""A profile on paper: decode step time of a dense transformer on a GPU from its memory bandwidth and FLOP/s (the
roofline), with efficiencies anchored to public vLLM measurements (the sources are in inflight_plan/profiles/*.json
and docs/planning.md). Used to write those profiles, for machines not at hand; never mixed with measured figures.

    step(b, c) = (weights + b * c * kv_bytes_per_token) / (bandwidth * mem_eff) + b * 2 * params / (flops * flop_eff)

Reading the weights and every sequence's KV cache is bandwidth-bound, the matmuls of b tokens compute-bound; the two
are added (they overlap only partly in a real engine, so this errs slow at mid batches). Training: 6 * params FLOPs
per token (forward + backward) at `train_mfu` of the devices' peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight_plan.profile import DecodeCurve, EngineProfile, Profile, TrainerProfile


@dataclass
class Hardware:
    name: str
    bandwidth: float  # bytes/s of device memory
    flops: float  # dense bf16 FLOP/s
    mem_eff: float = 0.77  # share of the bandwidth a decode step reaches
    flop_eff: float = 0.5  # share of the peak the batched matmuls reach
    train_mfu: float = 0.4  # model FLOP utilisation of training


@dataclass
class ModelShape:
    name: str
    params: float  # parameters (all matmuls, embeddings included)
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param  # K and V, every layer


def step_s(hw: Hardware, m: ModelShape, batch: int, context: int, tp: int = 1) -> float:
    """One decode step of `batch` sequences of `context` tokens on `tp` devices (tensor parallel, ideal split)."""
    memory = (m.weight_bytes + batch * context * m.kv_bytes_per_token) / (hw.bandwidth * hw.mem_eff * tp)
    compute = batch * 2 * m.params / (hw.flops * hw.flop_eff * tp)
    return memory + compute


def profile(hw: Hardware, m: ModelShape, *, batches: list[int], contexts: list[int], max_batch: int, source: str,
            notes: str, push_s: float, pause_s: float, tp: int = 1, overhead_s: float = 0.0) -> Profile:
    grid = [[step_s(hw, m, b, c, tp) for b in batches] for c in contexts]
    engine = EngineProfile(name="vLLM-like (roofline)", model=m.name, devices=tp, max_batch=max_batch,
                           decode=DecodeCurve(batches=batches, contexts=contexts, step_s=grid),
                           prefill_tokens_per_s=hw.flops * hw.flop_eff * tp / (2 * m.params))
    trainer = TrainerProfile(model=m.name, devices=1, tokens_per_s=hw.flops * hw.train_mfu / (6 * m.params),
                             step_overhead_s=1.0, scaling=1.0)
    return Profile(source=source, notes=notes, engine=engine, trainer=trainer, push_s=push_s, pause_s=pause_s,
                   overhead_s=overhead_s)
