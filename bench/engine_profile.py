"""Where a decode step of a real model goes in the built-in engine: the step's time (bench/engine.py's measurement)
against the same step's matmuls alone, on the engine's packed weights and on HF's nn.Linear modules, 1 thread.

    .venv/bin/python bench/engine_profile.py [MODEL_DIR]   # default .cache/models/smollm2-135m-instruct
"""
import asyncio
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
torch.set_num_threads(1)
from engine import EngineBench
from transformers import AutoConfig

from inflight.engine.model import precision as prec

path = sys.argv[1] if len(sys.argv) > 1 else ".cache/models/smollm2-135m-instruct"
cfg = AutoConfig.from_pretrained(path)
HID, INTER = cfg.hidden_size, cfg.intermediate_size
# multiply-adds per token: every layer matrix plus the output head
MACS = cfg.num_hidden_layers * HID * (HID + 2 * cfg.num_key_value_heads * HID // cfg.num_attention_heads + HID + 3 * INTER) + HID * cfg.vocab_size
for b in (32, 128):
    eb = EngineBench(path, b, 128, cfg.vocab_size) if b == 32 else eb
    n, cpu, wall = eb.run(b)
    print(f"batch {b}: {n / cpu:.0f} tok/CPU-s, {n / wall:.0f} tok/s wall; {wall / 128 * 1e3:.1f} ms per decode step (incl. prefill)")
    G = eb.eng.runner.gen
    x = torch.randn(b, HID)
    def mm():
        for L in G.layers:
            q = prec.linear(x, L["w_qkv"], L["b_qkv"])
            r = prec.residual(x, x, L["wo"], L["bo"])
            gu = prec.linear(x, L["w_gu"])
            r = prec.residual(x, gu[:, :INTER].contiguous(), L["wd"], None)
        return prec.linear(x, G.head, G.head_bias)
    mm()
    t0 = time.perf_counter(); [mm() for _ in range(5)]; t = (time.perf_counter() - t0) / 5
    head = lambda: prec.linear(x, G.head, G.head_bias)
    t1 = time.perf_counter(); [head() for _ in range(5)]; th = (time.perf_counter() - t1) / 5
    flops = 2 * b * MACS
    print(f"  bare matmuls of one step: {t * 1e3:.1f} ms ({flops / t / 1e9:.0f} GFLOP/s), of which the head {th * 1e3:.1f} ms; "
          f"type {type(G.layers[0]['w_gu']).__name__}")
eb.eng.stop()
from transformers import AutoModelForCausalLM

m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
for b in (32, 128):
    x = torch.randn(b, HID)
    def plain():
        for l in m.model.layers:
            a = l.self_attn
            a.q_proj(x); a.k_proj(x); a.v_proj(x); a.o_proj(x); l.mlp.gate_proj(x); u = l.mlp.up_proj(x); l.mlp.down_proj(u)
        return m.lm_head(x)
    with torch.inference_mode():
        plain(); t0 = time.perf_counter(); [plain() for _ in range(5)]; t = (time.perf_counter() - t0) / 5
    print(f"batch {b}: HF's nn.Linear matmuls of one step {t * 1e3:.1f} ms ({2 * b * MACS / t / 1e9:.0f} GFLOP/s)")
