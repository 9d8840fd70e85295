"""The simulator (inflight_plan) against real `inflight train` runs on this machine: samples/s and lag histograms.

    .venv/bin/python -m inflight.cli profile configs/cpu-demo.yaml --out runs/plan/cpu-demo.json --contexts 24,64
    .venv/bin/python bench/plan_check.py --profile runs/plan/cpu-demo.json [--config C] [--steps 60] [--report-only]

Each case is one short `inflight train CONFIG` run (configs/cpu-demo.yaml by default; configs/bench-scratch.yaml
is the generation-heavy scratchpad workload) (bench/pipeline.py's run_once; no evaluation,
fixed step count): pipelined keep at max_lag 0, 1, 4, pipelined interrupt at max_lag 1, sync (num_grad_steps 4).
From a run's metrics.jsonl: samples/s between the end of step --skip and the last step (the start-up left out),
the lag histogram of all trained tokens, and the workload the simulator needs (completion lengths, prompt tokens
per group, the share of samples back-propagated). The simulator then runs the same config on the profile and the
table gives predicted / measured samples/s and the total-variation distance of the two lag histograms.
While a run goes, each role's CPU seconds are sampled from /proc (RoleCpu), for a column of what each role really
spent per step beside what the simulator charges it. With --speed-index, the machine's speed against the profile
is measured before and after every run (inflight_plan/speed.py), and each run is also predicted at that speed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

CASES = {  # name: overrides of the config
    "keep-lag0": ["pipeline.mode=pipelined", "pipeline.update_mode=keep", "actor.max_lag=0"],
    "keep-lag1": ["pipeline.mode=pipelined", "pipeline.update_mode=keep", "actor.max_lag=1"],
    "keep-lag4": ["pipeline.mode=pipelined", "pipeline.update_mode=keep", "actor.max_lag=4"],
    "interrupt-lag1": ["pipeline.mode=pipelined", "pipeline.update_mode=interrupt", "actor.max_lag=1"],
    "sync-4": ["pipeline.mode=sync", "pipeline.num_grad_steps=4"],
}
COMMON = ["actor.eval_every=0", "pipeline.tensorboard=false", "pipeline.progress=false"]


def speed_index(config: Path, profile: str, path: Path) -> Path:
    """The machine's speed index against `profile` (inflight_plan/speed.py), in a fresh process as the profile was."""
    subprocess.run([sys.executable, "-m", "inflight_plan.speed", str(config), "--profile", profile, "--out", str(path)],
                   cwd=REPO, check=True)
    return path


class RoleCpu(threading.Thread):
    """Samples each role's CPU seconds, and its seconds runnable but waiting for a core, during a run (its process
    and its children: the actor's reward workers), for the pids the launcher logs (`roles_started`): what each role
    really spent and how long it queued for the 2 cores, beside what the simulator charges it."""

    def __init__(self, metrics: Path, out: Path, every_s: float = 0.25):
        super().__init__(daemon=True)
        self.metrics, self.out, self.every_s = metrics, out, every_s
        self.done = threading.Event()

    def run(self) -> None:
        from inflight_plan.reply import children_of, schedstat_s

        pids, samples, procs = None, [], {}
        seen: dict[str, dict[int, tuple[float, float]]] = {}  # role -> pid -> (CPU, wait) when last seen alive
        while not self.done.wait(self.every_s):
            if pids is None and self.metrics.exists():
                pids = next((json.loads(line)["pids"] for line in self.metrics.read_text().splitlines()
                             if '"roles_started"' in line), None)
            if pids:
                if len(samples) % 8 == 0:  # the children, from a scan of all of /proc: every 8th sample only
                    procs = {role: [pid, *children_of(pid)] for role, pid in pids.items()}
                for role, mine_pids in procs.items():  # a child that exits keeps its last reading: sums never fall
                    mine = seen.setdefault(role, {})
                    for p in mine_pids:
                        now, last = schedstat_s(p), mine.get(p, (0.0, 0.0))
                        mine[p] = (max(now[0], last[0]), max(now[1], last[1]))
                samples.append((time.time(), {role: sum(v[0] for v in mine.values()) for role, mine in seen.items()},
                                {role: sum(v[1] for v in mine.values()) for role, mine in seen.items()}))
        self.out.write_text(json.dumps(samples))


def role_cpu(run_dir: Path, skip: int) -> dict[str, float]:
    """CPU seconds per optimizer step of each role, and (`<role> wait`) seconds it waited for a core, between the
    end of step `skip` and the last step (RoleCpu's samples nearest inside that span); {} when not sampled."""
    path = run_dir.parent / f"{run_dir.name}.cpu.json"
    if not path.exists():
        return {}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"train_step"' in line]
    t_a, t_b = steps[max(1, skip) - 1]["time"], steps[-1]["time"]
    inside = [(t, *c) for t, *c in json.loads(path.read_text()) if t_a <= t <= t_b]
    if len(inside) < 2:
        return {}
    a, b = inside[0], inside[-1]
    per_s = (len(steps) - max(1, skip)) / (t_b - t_a)  # steps per second over the span
    out = {role: (b[1][role] - a[1][role]) / (b[0] - a[0]) / per_s for role in b[1] if role in a[1]}
    if len(b) > 2:  # sampled with the wait (earlier runs: CPU only)
        out.update({f"{role} wait": (b[2][role] - a[2][role]) / (b[0] - a[0]) / per_s for role in b[2] if role in a[2]})
    return out


def read(run_dir: Path, skip: int) -> dict:
    from inflight_plan.runs import read_run

    return {**read_run(run_dir, skip), "cpu": role_cpu(run_dir, skip)}


DEFAULT_CONFIG = REPO / "configs" / "cpu-demo.yaml"


def predict(profile, overrides: list[str], real: dict, steps: int, skip: int, cores: float = 0,
            config: Path = DEFAULT_CONFIG) -> dict:
    from inflight.config import RunConfig, load_config
    from inflight_plan.contention import simulate_shared
    from inflight_plan.sim import simulate
    from inflight_plan.workload import Lengths, from_run_config

    cfg = load_config(RunConfig, config, overrides)
    cfg.pipeline.max_steps = steps
    sim = from_run_config(cfg, Lengths(values=real["lengths"]), steps=steps, share_prompt=True,
                          prompt_tokens=round(real["prompt_tokens"]), trained_frac=real["trained_frac"])
    r = simulate_shared(profile, sim, cores) if cores else simulate(profile, sim)
    return {"samples_per_s": r.steady_samples_per_s(skip), "lag": r.lag_hist, "step_s": r.seconds_per_step,
            "trainer_busy": r.trainer_busy, "trainer_step_s": r.trainer_busy * r.seconds_per_step,
            "server_busy": sum(r.server_busy) / len(r.server_busy),
            "slowdown": r.extra.get("slowdown")}


def calibrate(profile, overrides: list[str], real: dict, steps: int, skip: int, cores: float,
              server_share: float, config: Path = DEFAULT_CONFIG) -> float:
    """Per-group reply work c, `server_share` of it stopping the server (server_s_per_group) and the rest on the
    actor (actor_s_per_group), added to what the profile holds, that makes the prediction of this one run match
    its samples/s (bisection; 0 when the profile alone already predicts less)."""
    def rate(c: float) -> float:
        prof = with_reply(profile, c, server_share)
        return predict(prof, overrides, real, steps, skip, cores, config)["samples_per_s"]

    if rate(0.0) <= real["samples_per_s"]:
        return 0.0
    lo, hi = 0.0, 0.02
    for _ in range(16):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > real["samples_per_s"] else (lo, mid)
    return (lo + hi) / 2


def with_reply(profile, c: float, server_share: float):
    """The profile with c seconds of reply work per group added, `server_share` of it on the server."""
    return profile.model_copy(update={"server_s_per_group": profile.server_s_per_group + c * server_share,
                                      "actor_s_per_group": profile.actor_s_per_group + c * (1 - server_share)})


def table(title: str, rows: list) -> None:
    print(f"\n{title}\n")
    print("| case | measured samples/s | predicted | pred/meas | measured s/step | trainer busy meas / pred | "
          "trainer s/step meas / pred | lag measured | lag predicted | TV distance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, real, pred in rows:
        # the trainer's seconds per step (busy share x step time): its own error, apart from the wall time's
        t_real = real["trainer_busy"] * real["step_s"]
        print(f"| {name} | {real['samples_per_s']:.0f} | {pred['samples_per_s']:.0f} | "
              f"{pred['samples_per_s'] / real['samples_per_s']:.2f} | {real['step_s'] * 1e3:.0f} ms | "
              f"{real['trainer_busy']:.0%} / {pred['trainer_busy']:.0%} | "
              f"{t_real * 1e3:.0f} / {pred['trainer_step_s'] * 1e3:.0f} ms | {share(real['lag'])} | "
              f"{share(pred['lag'])} | {tv(real['lag'], pred['lag']):.3f} |")


def summary(repeats: int, pairs: dict[str, list[tuple[dict, dict]]]) -> None:
    """Per case over its reps: measured samples/s median (min-max), predicted median, pred / meas median (min-max),
    TV distance median (max)."""
    med = statistics.median
    print(f"\nOver {repeats} runs per case (each predicted from its own workload): medians (min-max)\n")
    print("| case | measured samples/s | predicted | pred/meas | lag TV distance | trainer s/step pred/meas | "
          "CPU ms/step measured (server, trainer, actor + rewards) | simulated busy ms/step (server, trainer) | "
          "waiting for a core ms/step measured (server, trainer, actor) | simulated slowdown (server, trainer) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, ps in pairs.items():
        meas = [r["samples_per_s"] for r, _ in ps]
        ratio = [p["samples_per_s"] / r["samples_per_s"] for r, p in ps]
        dist = [tv(r["lag"], p["lag"]) for r, p in ps]
        train = [p["trainer_step_s"] / (r["trainer_busy"] * r["step_s"]) for r, p in ps]
        cpus = [r["cpu"] for r, _ in ps if r.get("cpu")]
        def ms(suffix: str) -> str:
            keys = [k + suffix for k in ("server0", "trainer", "actor")]
            return ", ".join(f"{med(c[k] for c in cpus) * 1e3:.0f}" for k in keys if all(k in c for c in cpus))
        cpu = ms("") if cpus else "not sampled"
        wait = (ms(" wait") if cpus else "") or "not sampled"
        slow = ", ".join(f"{med(p['slowdown'][k] for _, p in ps):.2f}" for k in ("server", "trainer")) \
            if all(p.get("slowdown") for _, p in ps) else "none"
        busy = (f"{med(p['server_busy'] * p['step_s'] for _, p in ps) * 1e3:.0f}, "
                f"{med(p['trainer_step_s'] for _, p in ps) * 1e3:.0f}")
        print(f"| {name} | {med(meas):.0f} ({min(meas):.0f}-{max(meas):.0f}) | "
              f"{med(p['samples_per_s'] for _, p in ps):.0f} | {med(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | "
              f"{med(dist):.3f} ({max(dist):.3f}) | {med(train):.2f} ({min(train):.2f}-{max(train):.2f}) | {cpu} | "
              f"{busy} | {wait} | {slow} |")


def tv(p: dict[int, int], q: dict[int, int]) -> float:
    """Total-variation distance of two histograms (each normalised): 0 same, 1 disjoint."""
    sp, sq = sum(p.values()) or 1, sum(q.values()) or 1
    return 0.5 * sum(abs(p.get(k, 0) / sp - q.get(k, 0) / sq) for k in set(p) | set(q))


def share(h: dict[int, int]) -> str:
    s = sum(h.values()) or 1
    return " ".join(f"{k}:{v / s:.2f}" for k, v in sorted(h.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="", help="profile JSON measured here (inflight profile); none: only run")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="the run config the cases override")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run (a multiple of 4)")
    ap.add_argument("--skip", type=int, default=12, help="steps left out of samples/s at the start (multiple of 4)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--out", default="", help="run folder (default runs/plan-check/<config name>)")
    ap.add_argument("--report-only", action="store_true", help="only read the runs already in --out")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per case (rep 0, 1, ...; a rep already in --out is read, not run again); with more than "
                         "one, a table of medians and ranges over the reps follows")
    ap.add_argument("--cores", type=float, default=0, help="model the roles sharing this many cores (0: no)")
    ap.add_argument("--calibrate", default="", help="FIRST,SECOND: also fit extra per-group reply work to these runs")
    ap.add_argument("--speed-index", action="store_true",
                    help="measure the machine's speed against --profile before and after each run "
                         "(inflight_plan/speed.py) and also predict each run from the profile rescaled by it")
    args = ap.parse_args(argv)
    if args.speed_index and not args.profile:
        ap.error("--speed-index needs --profile (it re-measures the profile's points)")
    config = Path(args.config).resolve()
    out = Path(args.out or REPO / "runs" / "plan-check" / config.stem)
    out.mkdir(parents=True, exist_ok=True)
    reals, reps = {}, {}
    previous = None  # the index measured after the previous run: the next run's "before"
    for rep in range(args.repeats):  # the cases in turn, so that a drift of the machine's load spreads over all
        for name in args.cases.split(","):
            mode = "sync" if "sync" in name else "pipelined"
            run_dir = out / f"{name}-{mode}-{rep}"
            if not args.report_only and not (run_dir / "summary.json").exists():
                from pipeline import run_once  # bench/pipeline.py: one `inflight train` subprocess

                if args.speed_index:
                    before = out / f"{run_dir.name}.speed-before.json"
                    if previous:
                        shutil.copy(previous, before)
                    else:
                        speed_index(config, args.profile, before)
                sampler = RoleCpu(run_dir / "metrics.jsonl", out / f"{run_dir.name}.cpu.json")
                sampler.start()
                run_once(config, name, mode, rep, out, 3.0, args.steps, CASES[name] + COMMON)
                sampler.done.set()
                sampler.join()
                if args.speed_index:
                    previous = speed_index(config, args.profile, out / f"{run_dir.name}.speed-after.json")
            else:
                previous = None
            r = read(run_dir, args.skip)
            r["speed"] = [json.loads(f.read_text()) for f in sorted(out.glob(f"{run_dir.name}.speed-*.json"))]
            reps.setdefault(name, []).append(r)
            reals.setdefault(name, r)
            print(f"{name} (rep {rep}): measured {r['samples_per_s']:.1f} samples/s, {r['step_s'] * 1e3:.0f} ms/step, "
                  f"lag {share(r['lag'])}", flush=True)
    if not args.profile:
        return 0
    from inflight_plan.profile import Profile

    profile = Profile.load(args.profile)
    results = {}
    def pred(prof, n: str, real: dict | None = None) -> dict:  # one run (default: the case's first) from its workload
        return predict(prof, CASES[n] + COMMON, real or reals[n], args.steps, args.skip, args.cores, config)

    rows = [(n, r, pred(profile, n)) for n, r in reals.items()]
    shared = f", roles sharing {args.cores:g} cores (contention.py)" if args.cores else ""
    reply = (f"; reply work as profiled: server {profile.server_s_per_request * 1e3:.2f} ms per group's requests, "
             f"{profile.server_s_per_group * 1e3:.2f} ms per group + "
             f"{profile.server_s_per_token * 1e6:.2f} us per token, actor {profile.actor_s_per_group * 1e3:.2f} ms + "
             f"{profile.actor_s_per_token * 1e6:.2f} us, trainer stream read {profile.trainer_s_per_group * 1e3:.2f} "
             f"ms + {profile.trainer_s_per_token * 1e6:.2f} us; the engine losing {profile.server_http_stall:.2f} s "
             "per second of the server's HTTP work")
    table(f"PREDICTED from profile {args.profile}{shared}{reply} vs MEASURED ({config.name}, runs in {out}; "
          f"samples/s after step {args.skip})", rows)
    results["profile"] = rows
    if args.repeats > 1:  # each rep predicted from its own workload (lengths, trained share)
        summary(args.repeats, {n: [(r, pred(profile, n, r)) for r in rs] for n, rs in reps.items()})
    if any(r["speed"] for rs in reps.values() for r in rs):  # each run from the profile at its measured speed
        from inflight_plan.speed import ratios, rescaled

        timed = {n: [(r, ratios(profile, r["speed"])) for r in rs if r["speed"]] for n, rs in reps.items()}
        for n, rs in timed.items():
            print(f"speed index, {n}: " + ", ".join(f"trainer x{t:.2f} engine x{e:.2f}" for _, (t, e) in rs))
        rows_s = [(n, rs[0][0], pred(rescaled(profile, *rs[0][1]), n, rs[0][0])) for n, rs in timed.items() if rs]
        table(f"PREDICTED from profile {args.profile} rescaled to the machine's speed measured before and after each "
              f"run (inflight_plan/speed.py){shared}", rows_s)
        results["speed_index"] = rows_s
        if args.repeats > 1:
            summary(args.repeats, {n: [(r, pred(rescaled(profile, *sp), n, r)) for r, sp in rs]
                                   for n, rs in timed.items() if rs})
    reply_fields = ["server_s_per_request",
                    *(f"{r}_s_per_{u}" for r in ("server", "actor", "trainer") for u in ("group", "token"))]
    if any(getattr(profile, f) for f in reply_fields):  # what the profile predicts without its reply work
        bare = profile.model_copy(update={f: 0.0 for f in reply_fields})
        rows0 = [(n, r, pred(bare, n)) for n, r in reals.items()]
        table(f"PREDICTED from the same profile without its reply work (server, actor, stream read: 0){shared}", rows0)
        results["no_reply"] = rows0
    if profile.engine.run_step_factor != 1.0:  # what the profile predicts with its engine's steps as plain ones
        e = profile.engine
        plain = profile.model_copy(update={"engine": e.model_copy(update={"run_step_factor": 1.0})})
        table(f"PREDICTED from the same profile with plain decode steps (run_step_factor 1, not "
              f"{e.run_step_factor:.3f}){shared}", [(n, r, pred(plain, n)) for n, r in reals.items()])
        if args.repeats > 1:
            summary(args.repeats, {n: [(r, pred(plain, n, r)) for r in rs] for n, rs in reps.items()})
    if profile.server_http_stall != 1.0:  # the server's HTTP work as a pause of a one-thread server
        one = profile.model_copy(update={"server_http_stall": 1.0})
        table(f"PREDICTED from the same profile with the HTTP work stopping the engine (server_http_stall 1, not "
              f"{profile.server_http_stall:.2f}){shared}", [(n, r, pred(one, n)) for n, r in reals.items()])
        if args.repeats > 1:
            summary(args.repeats, {n: [(r, pred(one, n, r)) for r in rs] for n, rs in reps.items()})
    if args.calibrate:  # fit c on the first run for each server share; keep the share that predicts the second
        first, second = args.calibrate.split(",")
        fits = []
        for share_ in (0.0, 0.25, 0.5, 0.75, 1.0):
            c = calibrate(profile, CASES[first] + COMMON, reals[first], args.steps, args.skip, args.cores, share_,
                          config)
            p2 = pred(with_reply(profile, c, share_), second)
            fits.append((abs(p2["samples_per_s"] / reals[second]["samples_per_s"] - 1), share_, c))
            print(f"calibration: server share {share_:.2f}: {c * 1e3:.2f} ms per group fits {first}; "
                  f"{second} predicted {p2['samples_per_s']:.0f} vs {reals[second]['samples_per_s']:.0f} measured")
        _, share_, c = min(fits)
        prof = with_reply(profile, c, share_)
        rows = [(n, r, pred(prof, n)) for n, r in reals.items()]
        table(f"PREDICTED{shared}, with {c * 1e3:.2f} ms of reply work per group ({share_:.0%} of it on the server, "
              f"the rest on the actor) fitted to the {first} and {second} runs on top of the profile's (those two "
              "rows match by construction; the others are predictions)", rows)
        results["calibrated"] = rows
    (out / "check.json").write_text(json.dumps({k: [{"case": n, "measured": {x: v for x, v in r.items()
                                                                             if x != "lengths"}, "predicted": p}
                                                    for n, r, p in rows] for k, rows in results.items()},
                                               indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
