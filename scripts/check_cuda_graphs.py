"""The built-in engine's CUDA decode path on a GPU, checked and measured in one run (docs/backends.md, "The built-in
engine's CUDA decode path"). Writes OUT/cuda_graphs.json after every part; exits 1 at the first failed check.

    python scripts/check_cuda_graphs.py --out runs/cuda-graphs                      # one GPU, Qwen2.5-0.5B-shaped
    python scripts/check_cuda_graphs.py --out /tmp/cg --device cpu --tiny --streams 4,8   # a dry run on CPU

Parts:
  attention  the Triton live-length kernel against the masked torch attention and a float64 softmax (bf16 and
             float32 caches, Qwen2.5-0.5B's heads, lengths across the chunk edges); time of both at the largest
             batch with a 2,048-token cache
  capture    an engine with cuda_graphs=on must report captured graphs (on CPU: eager replay); its log says why not
  match      greedy completions with graphs off and on: same tokens (fraction) and largest logprob difference
  speed      decode tokens/s at each --streams with graphs off and on (same engine settings, 16-token prompts)
  push       a full in-place update: every weight / KV / buffer address unchanged, outputs against graphs off again
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_smoke import build_models  # noqa: E402  (scripts/ is on the path: this file's folder)

from inflight.engine.core import InferenceEngine  # noqa: E402
from inflight.engine.model import decode_attention as da  # noqa: E402
from inflight.engine.model.sampling import SamplingParams  # noqa: E402


def attention_part(device: str) -> dict:
    out = {}
    g = torch.Generator().manual_seed(0)
    B, H, KV, D, T = 6, 14, 2, 64, 2048
    lens = torch.tensor([1, 255, 256, 257, 1000, 2048])
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(B, H, D, generator=g).to(dtype)
        kc, vc = (torch.randn(B + 2, KV, T, D, generator=g).to(dtype) for _ in range(2))
        slots = torch.tensor([3, 0, 7, 1, 5, 2])
        ref = torch.stack([torch.einsum("ht,htd->hd", torch.softmax(torch.einsum(
            "hd,htd->ht", q[b].double(), kc[slots[b], :, :n].double().repeat_interleave(H // KV, 0)) / 8, -1),
            vc[slots[b], :, :n].double().repeat_interleave(H // KV, 0)) for b, n in enumerate(lens.tolist())])
        args = [t.to(device) for t in (q, kc, vc, slots, lens)] + [1 / 8]
        fns = {"masked": da.masked_attention}
        if da.triton is not None and device != "cpu":
            fns["split"] = da.split_attention
        for name, fn in fns.items():
            err = (fn(*args).double().cpu() - ref).abs().max().item()
            out[f"{name}_{str(dtype)[6:]}_max_err"] = err
            if not err < (3e-2 if dtype == torch.bfloat16 else 1e-4):
                raise AssertionError(f"{name} attention ({dtype}) is off by {err}")
    if device != "cpu":  # time at the largest batch: the kernel reads live keys, the masked path the whole cache
        Bt, dt = 256, torch.bfloat16
        q = torch.randn(Bt, H, D, device=device, dtype=dt)
        kc, vc = (torch.randn(Bt, KV, T, D, device=device, dtype=dt) for _ in range(2))
        slots = torch.arange(Bt, device=device)
        lens = torch.randint(1, 512, (Bt,), device=device)
        for name, fn in (("masked", da.masked_attention), ("split", da.split_attention)):
            if name == "split" and da.triton is None:
                continue
            fn(q, kc, vc, slots, lens, 1 / 8)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn(q, kc, vc, slots, lens, 1 / 8)
            torch.cuda.synchronize()
            out[f"{name}_ms_b256_T2048_live512"] = (time.perf_counter() - t0) / 20 * 1e3
    return out


def engine(model: str, a: argparse.Namespace, graphs: str, max_batch: int) -> InferenceEngine:
    eng = InferenceEngine(model, dtype=a.dtype, device=a.device, max_batch=max_batch, max_model_len=a.max_model_len,
                          cuda_graphs=graphs)
    eng.start()
    return eng


def generate(eng: InferenceEngine, n: int, new: int, greedy: bool = True) -> tuple[list[list], float]:
    g = torch.Generator().manual_seed(n)
    prompts = torch.randint(10, 1000, (n, 16), generator=g).tolist()
    sp = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=new, ignore_eos=True)

    async def one(i: int, p: list[int]) -> list:
        return [(e.token_id, e.logprob) async for e in eng.generate(f"c{n}-{i}-{time.monotonic()}", p, sp,
                                                                    stream=False)]

    async def go() -> list[list]:
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    t0 = time.perf_counter()
    res = asyncio.run(go())
    return res, time.perf_counter() - t0


def compare(a: list[list], b: list[list]) -> dict:
    same = sum(x == y for ra, rb in zip(a, b) for (x, _), (y, _) in zip(ra, rb))
    total = sum(len(r) for r in a)
    # logprobs compared up to each row's first differing token (after it the contexts differ)
    diff = 0.0
    for ra, rb in zip(a, b):
        for (x, lx), (y, ly) in zip(ra, rb):
            diff = max(diff, abs(lx - ly))
            if x != y:
                break
    return {"same_tokens": same / total, "max_logprob_diff": diff}


def addresses(eng: InferenceEngine) -> dict:
    r = eng.runner
    out = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    out.update(kv=r.kv.data_ptr(), inputs=eng.graphs.inputs.data_ptr(), embed=r.gen.embed.data_ptr())
    out.update({f"{i}.{k}": v.data_ptr() for i, L in enumerate(r.gen.layers) for k, v in L.items()
                if isinstance(v, torch.Tensor)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (dry runs)")
    ap.add_argument("--model", default="", help="a model folder instead of the built Qwen2.5-0.5B-shaped one")
    ap.add_argument("--dtype", default="")
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    a = ap.parse_args()
    a.dtype = a.dtype or ("bfloat16" if a.device != "cpu" else "float32")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if a.device != "cpu" else "cpu", "dtype": a.dtype}

    def save() -> None:
        (out / "cuda_graphs.json").write_text(json.dumps(res, indent=1))

    streams = [int(s) for s in a.streams.split(",")]
    model = a.model or build_models(out, a.tiny, "float32")["untied"]
    try:
        res["attention"] = attention_part(a.device)
        save()
        on = engine(model, a, "on", max(streams))
        res["capture"] = on.graphs.status
        save()
        want = "captured" if a.device != "cpu" else "eager replay"
        if not on.graphs.status.startswith(want):
            raise AssertionError(f"graphs not in use: {on.graphs.status}")
        off = engine(model, a, "off", max(streams))
        base_on, _ = generate(on, 16, 32)
        base_off, _ = generate(off, 16, 32)
        res["match"] = compare(base_off, base_on)
        save()
        res["speed"] = {}
        for n in streams:
            for name, eng in (("off", off), ("on", on)):
                generate(eng, n, 8)  # warm-up at this batch
                _, s = generate(eng, n, a.new_tokens, greedy=False)
                res["speed"][f"{name}_{n}_tokens_per_s"] = n * a.new_tokens / s
            save()
        before = addresses(on)
        new = {n: p.detach() * 1.01 for n, p in on.model.named_parameters() if n not in on.tied_aliases}
        for eng in (on, off):
            asyncio.run(eng.run_paused(lambda eng=eng: eng.load_weights(new, 1)))
        moved = [k for k, v in addresses(on).items() if before[k] != v]
        after_on, _ = generate(on, 16, 32)
        after_off, _ = generate(off, 16, 32)
        res["push"] = {"moved": moved, **compare(after_off, after_on)}
        save()
        if moved:
            raise AssertionError(f"an update moved {moved[:5]}")
        on.stop()
        off.stop()
    except Exception as e:  # noqa: BLE001 - recorded, then the exit status says it failed
        res["failed"] = f"{type(e).__name__}: {e}"
        save()
        print(json.dumps(res, indent=1))
        return 1
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
