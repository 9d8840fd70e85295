"""Peak memory and time of the head's logprobs + entropy, forward and backward, three ways (not a test):

    .venv/bin/python bench/head_memory.py [--tokens 4096] [--vocab 49152] [--hidden 576] [--dtype float32|bfloat16]
                                          [--ways naive,full,chunked] [--repeat 3]

- `full`: the model's full logits (hidden @ W.T, [T, V]), then token_logprobs (logprobs.py: float32 a chunk of rows
  at a time, each chunk recomputed in backward), as the trainer ran before the chunked head;
- `naive`: the full logits through log_softmax in float32 (what a plain implementation does);
- `chunked`: head.head_logprobs, the trainer's path now (no [T, V] tensor in forward or backward).

Each runs in a fresh process; its peak is the process's peak resident memory (VmHWM) less its resident memory just
before the computation (inputs allocated), so it counts every temporary, gradients of hidden and weight included.
Times are CPU time (time.process_time), the median of --repeat runs after one warm-up. Defaults: SmolLM2-135M's
head (hidden 576, vocabulary 49152) on 4096 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def run_one(way: str, tokens: int, vocab: int, hidden: int, dtype: str, repeat: int) -> dict:
    import torch

    from inflight.contracts import Sample
    from inflight.trainer.head import head_logprobs
    from inflight.trainer.logprobs import token_logprobs
    from inflight.trainer.packing import collate

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    n = 256  # tokens per sample
    samples = [Sample("g", [1], [int(x) for x in torch.randint(0, vocab, (n - 1,))], [0.0] * (n - 1), [0] * (n - 1))
               for _ in range(tokens // n)]
    batch = collate(samples, [1.0] * len(samples), len(samples), tokens)
    h = (torch.randn(tokens, hidden) * 0.5).to(dt).requires_grad_(True)
    w = (torch.randn(vocab, hidden) * 0.05).to(dt).requires_grad_(True)
    ids = batch.input_ids
    first = batch.position_ids == 0

    def step():
        h.grad = w.grad = None
        if way == "chunked":
            t = torch.nonzero(~first[1:])[:, 0] + 1
            lp, ent = head_logprobs(h, w, t - 1, ids[t], 1.0, True)
        elif way == "full":
            lp, ent = token_logprobs(h @ w.T, batch, need_entropy=True)
        else:
            logp = torch.log_softmax((h @ w.T).float(), -1)
            lp = logp[:-1].gather(1, ids[1:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
        (lp.sum() + ent.sum()).backward()

    before = _status("VmRSS")
    step()  # warm-up; its peak is the measured one (later runs reuse the freed memory)
    peak = _status("VmHWM") - before
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        step()
        times.append(time.process_time() - t0)
    return {"way": way, "peak_mb": peak / 2**20, "cpu_s": statistics.median(times)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ways", default="naive,full,chunked", help="which of naive, full, chunked (comma-separated)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a.tokens, a.vocab, a.hidden, a.dtype, a.repeat)))
        return 0
    rows = []
    for way in a.ways.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", way, "--tokens", str(a.tokens), "--vocab",
                              str(a.vocab), "--hidden", str(a.hidden), "--dtype", a.dtype, "--repeat", str(a.repeat)],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mb = a.tokens * a.vocab * 4 / 2**20
    print(f"{a.tokens} tokens x {a.vocab} vocabulary, hidden {a.hidden}, {a.dtype} "
          f"(float32 logits of all tokens: {logits_mb:.0f} MB)")
    for r in rows:
        print(f"  {r['way']:8s} peak {r['peak_mb']:8.0f} MB   {r['cpu_s']:.2f} s CPU   "
              f"peak / last {r['peak_mb'] / rows[-1]['peak_mb']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
