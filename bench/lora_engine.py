"""The built-in engine's side of an adapter (LoRA) push against a full one: what the engine pauses for (not a test).

    .venv/bin/python bench/lora_engine.py [--model .cache/models/smollm2-135m-instruct] [--ranks 1,8,32] [--pushes 3]
        [--precision float32|bfloat16|int8]

In this process: an InferenceEngine (float32 generator unless --precision, 1 torch thread, `--batch` streaming requests decoding throughout) and
its WeightReceiver, fed safetensors files under /dev/shm (the file transport: the read is outside the pause for both
kinds). Full update: every parameter, perturbed. Adapter: rank r on every linear weight of every layer (q, k, v, o,
gate, up, down), B and A random. Per push: the file's bytes, the receiver's receive seconds (read + NaN check), merge
seconds (W0 + s*B@A on a worker thread while the engine decodes; adapters only), and the engine's pause (the copy of
the new matrices into the model and the re-derivation of the generator's weights; float32 re-packing is left to a
background thread for both kinds). Medians over `--pushes`. bench/lora.py (the trainer side) measures the whole push
over every transport from a LoRA trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.engine.core import InferenceEngine  # noqa: E402
from inflight.engine.model.sampling import SamplingParams  # noqa: E402
from inflight.engine.weights.receiver import WeightReceiver  # noqa: E402
from inflight.transport.schemas import WeightUpdateRequest  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2-135m-instruct"


def updates(eng: InferenceEngine, ranks: list[int]) -> list[tuple[str, dict, dict | None]]:
    g = torch.Generator().manual_seed(0)
    params = {n: p.detach() for n, p in eng.model.named_parameters()}
    out = [("full", {n: p + 1e-3 * torch.randn(p.shape, generator=g) for n, p in params.items()}, None)]
    linears = [n for n in params if n.endswith("_proj.weight")]
    for r in ranks:
        ad = {}
        for n in linears:
            o, i = params[n].shape
            ad[n + ".lora_A"] = 1e-2 * torch.randn(r, i, generator=g)
            ad[n + ".lora_B"] = 1e-2 * torch.randn(o, r, generator=g)
        out.append((f"adapter r={r}", ad, {"rank": r, "scaling": 2.0}))
    return out


async def run(args) -> None:
    torch.set_num_threads(1)
    eng = InferenceEngine(str(args.model), max_batch=args.batch, max_model_len=512, threads=1,
                          generator_precision=args.precision)
    receiver = WeightReceiver(eng)
    eng.start()
    stop = asyncio.Event()

    async def decode(i: int) -> None:  # keeps the engine stepping: a pause waits for a step boundary
        while not stop.is_set():
            async for _ in eng.generate(f"bg{i}-{os.urandom(4).hex()}", [1, 2, 3, 4],
                                        SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True)):
                if stop.is_set():
                    break

    tasks = [asyncio.create_task(decode(i)) for i in range(args.batch)]
    version = 0
    print(f"model {args.model.name}, {sum(p.numel() for p in eng.model.parameters()) / 1e6:.0f}M parameters, "
          f"generator {args.precision}, batch {args.batch} decoding, 1 thread")
    print(f"{'update':<14} {'MB':>8} {'receive s':>10} {'merge s':>8} {'pause s':>8}")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        for name, tensors, adapter in updates(eng, args.ranks):
            path = os.path.join(d, "update.safetensors")
            save_file(tensors, path)
            rows = []
            for _ in range(args.pushes):
                version += 1
                await asyncio.sleep(args.gap_s)
                await receiver.update(WeightUpdateRequest(version=version, path=path, adapter=adapter))
                rows.append(receiver.last_update)
            med = {k: statistics.median(r[k] for r in rows) for k in ("receive_s", "merge_s", "pause_s")}
            mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
            print(f"{name:<14} {mb:8.1f} {med['receive_s']:10.3f} {med['merge_s']:8.3f} {med['pause_s']:8.4f}",
                  flush=True)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    eng.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--ranks", default="1,8,32")
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--gap-s", type=float, default=0.5)
    p.add_argument("--precision", default="float32", help="server.generator_precision: float32, bfloat16, int8, ...")
    args = p.parse_args()
    args.ranks = [int(r) for r in args.ranks.split(",")]
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
