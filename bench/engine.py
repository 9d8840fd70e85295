"""Decode throughput of the built-in engine beside HF `generate` (static batch) and transformers'
ContinuousBatchingManager (`generate_batch` with an explicit ContinuousBatchingConfig), on llama models built
locally from config. Prints tokens/s and ratios from one run, and the cost of a weight update.

    .venv/bin/python bench/engine.py [--new-tokens 128] [--batches 1,8,32,128] [--threads 1] [--repeats 3] [--no-cb]
    .venv/bin/python bench/engine.py --model .cache/models/smollm2-135m-instruct --no-cb --no-torch-ops  # a real model
    .venv/bin/python bench/engine.py ... --precision bfloat16   # the engine with bf16 generator weights

Tokens/s are given twice: per second of this process's CPU time (time.process_time, all its threads: engine
thread, asyncio consumer, HF) and per second of wall time. On a shared machine the wall figures swing with other
people's load; the CPU-time ratios are the ones to compare. The weight-update lines give the time the engine is
paused per update (run_paused + load_weights of every parameter) and the bytes/s of applying it beside a plain
memory copy of the same bytes.

The engine's requests use `generate(..., stream=False)`: each request's tokens are handed over once when it ends,
as HF's static batch returns them, and as the server does for requests that neither stream nor have stop strings.

For each (model, batch) the engine, the engine with its C kernels turned off (torch ops instead: the ratio that
justifies cpu_kernels.c), HF `generate` and (at --cb-batches) the CB manager run back to back, so they see the same
machine load, --repeats times in turn (A B C A B C); the table gives medians, ratios with their min-max over the
rounds. On a shared, oversubscribed machine use --threads 1: with more threads than free cores,
OpenMP barriers make every library slow by a varying factor and the ratios mean little.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = {  # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (128, 3, 4, 2, 384, 512),
    "small": (256, 6, 8, 4, 768, 2048),
}


def build(out: Path, size: str) -> tuple[Path, int]:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0").save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def prompts(batch: int, vocab: int, length: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


class EngineBench:
    def __init__(self, path: Path, max_batch: int, new: int, vocab: int, precision: str = "float32"):
        from inflight.engine.core import InferenceEngine

        self.eng = InferenceEngine(str(path), max_batch=max_batch, max_model_len=16 + new + 1,
                                   generator_precision=precision)
        self.eng.start()
        self.new, self.vocab = new, vocab
        self._run(2)  # warm-up

    def run(self, b: int, kernels: bool = True) -> tuple[float, float, float]:
        """kernels=False: the same engine with the runner's C kernels turned off for this run (torch ops)."""
        runner = self.eng.runner
        saved = runner.kernels
        runner.kernels = saved if kernels else None
        try:
            return self._run(b)
        finally:
            runner.kernels = saved

    def _run(self, b: int) -> tuple[float, float, float]:
        from inflight.engine.core import SamplingParams

        sp = SamplingParams(max_tokens=self.new, ignore_eos=True)

        async def one(rid: str, p: list[int]) -> int:
            return sum([e.token_id >= 0 async for e in self.eng.generate(rid, p, sp, stream=False)])

        async def go() -> int:
            return sum(await asyncio.gather(*[one(f"b{b}-{i}", p) for i, p in enumerate(prompts(b, self.vocab))]))

        return timed(lambda: asyncio.run(go()))

    def weight_update(self, repeats: int = 5) -> tuple[float, float, float]:
        """(seconds paused per update, bytes/s applying it, bytes/s of a plain copy of the same bytes)."""
        eng = self.eng
        new = {n: p.detach().clone() + 1e-3 for n, p in eng.model.named_parameters()}
        nbytes = sum(t.numel() * t.element_size() for t in new.values())
        pauses = []
        for _ in range(repeats):  # seen from the caller: hand-over to the engine thread + copy + hand-back
            t0 = time.perf_counter()
            asyncio.run(eng.run_paused(lambda: eng.load_weights(new, eng.version + 1)))
            pauses.append(time.perf_counter() - t0)
        applies = []
        for _ in range(repeats):
            async def apply() -> float:
                def fn() -> float:
                    t0 = time.perf_counter()
                    eng.load_weights(new, eng.version + 1)
                    return time.perf_counter() - t0
                return await eng.run_paused(fn)
            applies.append(asyncio.run(apply()))
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        copies = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        return min(pauses), nbytes / min(applies), nbytes / min(copies)


def timed(fn) -> tuple[float, float, float]:
    """(result, CPU seconds of this process, wall seconds)."""
    c0, t0 = time.process_time(), time.perf_counter()
    n = fn()
    return n, time.process_time() - c0, time.perf_counter() - t0


class HFBench:
    def __init__(self, path: Path, new: int, vocab: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.new, self.vocab = new, vocab
        self.model.generate(torch.tensor(prompts(2, vocab)), do_sample=True, max_new_tokens=4, min_new_tokens=4,
                            pad_token_id=0)

    def generate(self, b: int) -> tuple[float, float, float]:
        ids = torch.tensor(prompts(b, self.vocab))

        def go() -> int:
            with torch.inference_mode():
                res = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                          max_new_tokens=self.new, min_new_tokens=self.new, pad_token_id=0)
            return (res.shape[1] - ids.shape[1]) * b

        return timed(go)

    def continuous(self, b: int) -> tuple[float, float, float]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        new = self.new
        gc = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, eos_token_id=-1, pad_token_id=0)
        cbc = ContinuousBatchingConfig(page_size=32, num_blocks=max(16, b * (16 + new) // 32 + 8),
                                       max_batch_tokens=max(256, b * 16))
        def go() -> int:
            res = self.model.generate_batch(prompts(b, self.vocab), generation_config=gc,
                                            continuous_batching_config=cbc)
            return sum(len(r.generated_tokens) for r in res.values())

        return timed(go)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cb", action="store_true", help="skip ContinuousBatchingManager (slow)")
    ap.add_argument("--cb-batches", default="32", help="batches for ContinuousBatchingManager")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of all systems in turn; medians are reported")
    ap.add_argument("--model", default="", help="a HF model folder to measure instead of --sizes (e.g. SmolLM2-135M)")
    ap.add_argument("--precision", default="float32",
                    help="the engine's server.generator_precision (float32, bfloat16, bfloat16-fp32-head, int8); "
                         "HF generate stays float32")
    ap.add_argument("--no-torch-ops", action="store_true", help="skip the engine with its C kernels turned off")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    cb_batches = [int(b) for b in args.cb_batches.split(",")]
    rows, updates = [], []
    rate = lambda r: (r[0] / r[1], r[0] / r[2])  # noqa: E731  (tokens per CPU second, per wall second)
    with tempfile.TemporaryDirectory() as tmp:
        for size in [args.model] if args.model else args.sizes.split(","):
            if args.model:  # a real checkpoint: random prompts over its own vocabulary
                from transformers import AutoConfig
                path, vocab = Path(args.model), AutoConfig.from_pretrained(args.model).vocab_size
                n_params = sum(t.numel() for t in load_tensors(path).values())
                size = path.name
            else:
                path, n_params = build(Path(tmp) / size, size)
                vocab = SIZES[size][-1]
            eng, hf = EngineBench(path, max(batches), args.new_tokens, vocab, args.precision), HFBench(path, args.new_tokens, vocab)
            name = f"{size} ({n_params / 1e6:.1f}M)"
            for b in batches:
                runs = {k: [] for k in ("engine", "torch ops", "hf", "cb")}
                for _ in range(args.repeats):  # all systems back to back, so they see the same machine load
                    runs["engine"].append(rate(eng.run(b)))
                    if eng.eng.runner.kernels is not None and not args.no_torch_ops:
                        runs["torch ops"].append(rate(eng.run(b, kernels=False)))
                    runs["hf"].append(rate(hf.generate(b)))
                    if not args.no_cb and b in cb_batches:
                        runs["cb"].append(rate(hf.continuous(b)))
                rows.append((name, b, runs))
                print(name, b, {k: [round(r[0]) for r in v] for k, v in runs.items()}, flush=True)
            updates.append((name, n_params * 4, *eng.weight_update()))
            print(updates[-1], flush=True)
            eng.eng.stop()
    print(f"\ndecode tokens/s, {args.new_tokens} new tokens, fp32, {args.threads} threads, median of {args.repeats}; "
          "per CPU second (per wall second in brackets); ratios: median (min-max) over the rounds")
    print("| model | batch | engine | engine, torch ops | C kernels / torch ops | HF generate | engine / HF | "
          "HF CB manager | engine / CB |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = statistics.median

    def cell(v: list) -> str:
        return f"{med([r[0] for r in v]):.0f} ({med([r[1] for r in v]):.0f})" if v else "-"

    def ratio(a: list, b: list) -> str:
        if not a or not b:
            return "-"
        rs = [x[0] / y[0] for x, y in zip(a, b)]
        return f"{med(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"

    for name, b, r in rows:
        print(f"| {name} | {b} | {cell(r['engine'])} | {cell(r['torch ops'])} | {ratio(r['engine'], r['torch ops'])} | "
              f"{cell(r['hf'])} | {ratio(r['engine'], r['hf'])} | {cell(r['cb'])} | {ratio(r['engine'], r['cb'])} |")
    print("\nweight update (all parameters, in place, engine idle)")
    print("| model | bytes | paused per update | apply bytes/s | plain memory copy bytes/s | apply/copy |")
    print("|---|---|---|---|---|---|")
    for name, nbytes, pause, apply_bps, copy_bps in updates:
        print(f"| {name} | {nbytes / 1e6:.1f} MB | {pause * 1e3:.2f} ms | {apply_bps / 1e9:.2f} GB/s | "
              f"{copy_bps / 1e9:.2f} GB/s | {apply_bps / copy_bps:.2f} |")


if __name__ == "__main__":
    main()
