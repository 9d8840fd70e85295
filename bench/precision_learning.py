"""Learning with a lower-precision generator: the CPU demo's pipelined run for each `server.generator_precision` and
each loss, from the same warm-started model, runs alternating; held-out accuracy, time to a target, samples/s.

    .venv/bin/python bench/precision_learning.py [--precisions float32,int8]
        [--losses grpo-nois,grpo-tis,aipo,decoupled_ppo] [--minutes 2] [--repeats 1] [--gain 20]
        [--model .cache/peers/models/warm]

Losses: `grpo-nois` = grpo without an importance weight (algo.is_cap=0: the generator's mismatch goes uncorrected),
`grpo-tis` = grpo with the truncated π/μ weight (is_cap=5), `aipo`, `decoupled_ppo`. The model defaults to the one
bench/peers.py warm-starts (`bench/peers.py --setup`). Each run is `inflight train configs/cpu-demo.yaml` with the
held-out evaluation every 10 steps; the runs are read with bench/pipeline.py's reader.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOSSES = {"grpo-nois": ["algo.loss=grpo", "algo.is_cap=0"], "grpo-tis": ["algo.loss=grpo", "algo.is_cap=5"],
          "aipo": ["algo.loss=aipo"], "decoupled_ppo": ["algo.loss=decoupled_ppo"]}


def load_pipeline_bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", REPO / "bench" / "pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", default="float32,int8")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--gain", type=float, default=20.0, help="target = warm-start accuracy + this many points")
    ap.add_argument("--model", type=Path, default=REPO / ".cache" / "peers" / "models" / "warm")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench-precision")
    args = ap.parse_args()
    bp = load_pipeline_bench()
    args.out.mkdir(parents=True, exist_ok=True)
    precisions, losses = args.precisions.split(","), args.losses.split(",")
    common = [f"model.path={args.model}", 'task.prompt="{expr}="', "actor.eval_every=10", "pipeline.progress=false",
              "pipeline.tensorboard=false"]
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for loss in losses:
            for prec in precisions:  # the precisions of one loss back to back: drift hits the pair alike
                extra = [*common, *LOSSES[loss], f"server.generator_precision={prec}"]
                run_dir = bp.run_once(REPO / "configs" / "cpu-demo.yaml", f"{prec}-{loss}", "pipelined", rep,
                                      args.out, args.minutes, 0, extra)
                runs.setdefault((prec, loss), []).append(bp.read_run(run_dir))

    warm = statistics.median(r["first_acc"] for rs in runs.values() for r in rs if r.get("first_acc") is not None)
    target = warm + args.gain / 100
    print(f"\nwarm start {warm:.1%}; target {target:.1%} (+{args.gain:.0f} points); {args.minutes} min per run, "
          f"{args.repeats} repeat(s); medians")
    print("| loss | generator | samples/s | best acc | last acc | s to target | time to target vs float32 |")
    print("|---|---|---|---|---|---|---|")

    def med(rs: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    for loss in losses:
        base = [bp.time_to(r, target) for r in runs[(precisions[0], loss)]]
        base_t = statistics.median([t for t in base if t is not None]) if any(t is not None for t in base) else None
        for prec in precisions:
            rs = runs[(prec, loss)]
            times = [t for t in (bp.time_to(r, target) for r in rs) if t is not None]
            t = statistics.median(times) if times else None
            ratio = f"{base_t / t:.2f}× sooner" if t and base_t else "-"
            print(f"| {loss} | {prec} | {bp._f(med(rs, 'samples_per_s'))} | {bp._f(med(rs, 'best_acc'), '{:.1%}')} | "
                  f"{bp._f(med(rs, 'last_acc'), '{:.1%}')} | {bp._f(t, '{:.0f}', 'not reached')} | {ratio} |")


if __name__ == "__main__":
    main()
