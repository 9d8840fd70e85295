"""bench/plan_check.py's arithmetic on a hand-written metrics.jsonl: samples/s after the skipped steps, the lag
histogram, the workload it hands the simulator, and the total-variation distance."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_read_and_tv(tmp_path):
    b = load("plan_check")
    steps = [{"event": "train_step", "time": 100.0 + 0.5 * i, "samples_total": 16 * (i + 1), "samples": 16,
              "lag_hist": {"0": 10, "1": 30} if i % 2 else {"0": 40}, "completion_len_mean": 5.0,
              "completion_len_min": 2, "completion_len_max": 9, "prompt_tokens": 20,
              "group_indices": [2 * i, 2 * i + 1],
              "trained_samples": 12, "train_s": 0.25} for i in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    r = b.read(tmp_path, skip=2)
    assert r["samples_per_s"] == pytest.approx(32 / 1.0)  # steps 3 and 4 over the second after step 2
    assert r["lag"] == {0: 100, 1: 60}
    assert r["prompt_tokens"] == pytest.approx(10.0) and r["trained_frac"] == pytest.approx(0.75)
    assert len(r["lengths"]) == 64 and sum(r["lengths"]) / 64 == pytest.approx(5.0, abs=0.1)
    assert min(r["lengths"]) == 2 and max(r["lengths"]) == 9
    assert b.tv({0: 1}, {0: 5}) == 0.0 and b.tv({0: 1}, {1: 1}) == 1.0
    assert b.tv({0: 3, 1: 1}, {0: 1, 1: 1}) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        b.read(tmp_path, skip=4)


def test_report_only_prints_the_prediction_with_and_without_the_reply_work_and_at_the_measured_speed(tmp_path,
                                                                                                    capsys):
    from tests.plan.test_sim import flat_profile

    b = load("plan_check")
    run = tmp_path / "keep-lag1-pipelined-0"
    run.mkdir()
    steps = [{"event": "train_step", "time": 10.0 + 0.2 * i, "samples_total": 128 * (i + 1), "samples": 128,
              "lag_hist": {"1": 900}, "completion_len_mean": 8.0, "completion_len_min": 4, "completion_len_max": 12,
              "prompt_tokens": 14 * 16, "group_indices": list(range(16 * i, 16 * i + 16)), "trained_samples": 64,
              "train_s": 0.1} for i in range(8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    prof = flat_profile(step_s=0.002, tok_s=50000.0).model_copy(update={"server_s_per_group": 0.002,
                                                                      "actor_s_per_token": 1e-5})
    path = prof.save(tmp_path / "p.json")
    for when, tok_s in (("before", 80000.0), ("after", 125000.0)):  # the trainer 2x as fast, the engine 1.25x
        (tmp_path / f"keep-lag1-pipelined-0.speed-{when}.json").write_text(json.dumps(
            {"trainer_tokens_per_s": tok_s, "decode_step_s": 0.0016, "batch": 128, "context": 1}))
    assert b.main(["--profile", str(path), "--out", str(tmp_path), "--report-only", "--cases", "keep-lag1",
                   "--steps", "8", "--skip", "2"]) == 0
    out = capsys.readouterr().out
    assert "server 0.00 ms per group's requests, 2.00 ms per group +" in out and "without its reply work" in out
    res = json.loads((tmp_path / "check.json").read_text())
    with_reply, without = res["profile"][0]["predicted"], res["no_reply"][0]["predicted"]
    assert res["profile"][0]["measured"]["samples_per_s"] == pytest.approx(128 / 0.2)
    assert with_reply["samples_per_s"] < without["samples_per_s"]  # the reply work stops the server
    assert "speed index, keep-lag1: trainer x2.00 engine x1.25" in out
    assert res["speed_index"][0]["predicted"]["samples_per_s"] > with_reply["samples_per_s"]
    more = b.with_reply(prof, 0.004, 0.5)  # calibration adds to what the profile holds
    assert more.server_s_per_group == pytest.approx(0.004) and more.actor_s_per_group == pytest.approx(0.002)
    assert more.actor_s_per_token == pytest.approx(1e-5)


def test_role_cpu_samples_the_roles_and_counts_cpu_per_step(tmp_path):
    import os
    import subprocess
    import sys

    b = load("plan_check")
    run = tmp_path / "sync-4-sync-0"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    # a "trainer" and an "actor" that each work 0.5 s of CPU, in processes of their own as roles are, both pinned to
    # one core: each waits for it while the other runs
    core = min(os.sched_getaffinity(0))  # one this process may use (a container's cpuset need not hold core 0)
    code = (f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nt = time.process_time()\n"
            "while time.process_time() - t < 0.5: pass\ntime.sleep(0.5)")
    busy = {role: subprocess.Popen([sys.executable, "-c", code]) for role in ("trainer", "actor")}
    metrics.write_text(json.dumps({"event": "roles_started", "pids": {r: p.pid for r, p in busy.items()}}) + "\n")
    sampler = b.RoleCpu(metrics, tmp_path / "sync-4-sync-0.cpu.json", every_s=0.05)
    sampler.start()
    for p in busy.values():
        p.wait()
    sampler.done.set()
    sampler.join()
    samples = json.loads((tmp_path / "sync-4-sync-0.cpu.json").read_text())
    for role in busy:  # and kept after it exited
        assert 0.3 <= samples[-1][1][role] - samples[0][1][role] <= 0.6
        # queued behind the other (longer when other work shares the core: the suite runs on two workers); in
        # seconds, not the kernel's nanoseconds
        assert 0.15 <= samples[-1][2][role] - samples[0][2][role] <= 3.0
    # 5 steps 0.5 s apart; two samples inside the span after step 1, 1.0 s apart, 0.4 CPU s: 2 steps/s -> 0.2 s/step
    steps = [{"event": "train_step", "time": 100.0 + 0.5 * i} for i in range(5)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "sync-4-sync-0.cpu.json").write_text(json.dumps(
        [[99.9, {"trainer": 0.0}, {"trainer": 0.0}], [100.6, {"trainer": 1.0}, {"trainer": 0.5}],
         [101.6, {"trainer": 1.4}, {"trainer": 0.6}], [103.0, {"trainer": 9.0}, {"trainer": 9.0}]]))
    assert b.role_cpu(run, skip=1) == {"trainer": pytest.approx(0.2), "trainer wait": pytest.approx(0.05)}
    # samples written before the wait was recorded: CPU only
    (tmp_path / "sync-4-sync-0.cpu.json").write_text(json.dumps(
        [[99.9, {"trainer": 0.0}], [100.6, {"trainer": 1.0}], [101.6, {"trainer": 1.4}], [103.0, {"trainer": 9.0}]]))
    assert b.role_cpu(run, skip=1) == {"trainer": pytest.approx(0.2)}
