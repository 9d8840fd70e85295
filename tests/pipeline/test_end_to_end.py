"""The whole pipeline, for real: `inflight serve` processes, the trainer and the actor as processes, weights over
a gloo process group, the in-memory stream. Tiny random model, a few steps; each test is one run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.pipeline_helpers import free_base_port, free_port, records

pytestmark = pytest.mark.slow

PROMISED = ["config.yaml", "metrics.jsonl", "report.html", "summary.json", "checkpoints/final/config.json",
            "logs/trainer.log", "logs/actor.log", "logs/server0.log", "logs/server1.log"]
PLOTS = ["accuracy", "reward", "lengths", "lag_hist", "server_throughput", "pause", "trainer", "lr"]


def overrides(model_dir: Path, run_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}", f"name={name}", f"pipeline.run_dir={run_dir}",
        "server.num_servers=2", f"server.base_port={free_base_port(2)}", "server.threads=1", "server.max_batch=64",
        f"pipeline.weight_sync_port={free_port()}", "trainer.threads=1", "pipeline.progress=false",
        "task.eval_size=16", "actor.eval_every=3", "actor.group_size=4", "actor.groups_per_step=2",
        "actor.max_new_tokens=160", "actor.max_lag=2", "pipeline.max_steps=8", "pipeline.tensorboard=true",
        # a random model stops (EOS) within 160 tokens only now and then: steps mix both endings, and warn often
        "pipeline.warn_truncated_frac=0.05", "pipeline.warn_truncated_steps=2", *extra,
    ]


def run_train(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "inflight.cli", "train", "/dev/null", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def check_common(run: Path, max_steps: int) -> list[dict]:
    for rel in PROMISED:
        assert (run / rel).exists(), f"missing {rel}"
    for png in PLOTS:
        assert (run / "plots" / f"{png}.png").stat().st_size > 1000
    assert any((run / "tensorboard" / "trainer").iterdir())
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, max_steps + 1))
    assert all(r["samples"] == 8 for r in steps)  # exactly groups_per_step * group_size per optimizer step
    # every server ends on the final weights, and its version went up during the run
    for k in (0, 1):
        versions = [r["weight_version"] for r in records(run, "server_metrics") if r["server"] == k]
        assert versions[-1] == max_steps and versions == sorted(versions) and len(set(versions)) >= 2
    base = records(run, "eval")[0]  # the starting weights, evaluated before RL (all tokens version 0)
    assert base.get("base") and base["version_max"] == 0 and 0.0 <= base["accuracy"] <= 1.0
    final = [r for r in records(run, "eval") if r.get("final")]
    assert len(final) == 1 and final[0]["version_min"] == max_steps and 0.0 <= final[0]["accuracy"] <= 1.0
    roles = {json.loads(line)["role"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert roles == {"launcher", "trainer", "actor"}
    check_lengths(run, steps)
    return steps


def check_lengths(run: Path, steps: list[dict]) -> None:
    """Completion lengths and endings per step in metrics.jsonl, TensorBoard and the report; the truncation
    warning exactly when its rule says; held-out replies in the report, escaped."""
    import html

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from inflight.report.replies import visible
    from inflight.trainer.loop.completions import TruncationAlarm

    for r in steps:
        assert 1 <= r["completion_len_min"] <= r["completion_len_mean"] <= r["completion_len_max"] <= 160
        assert r["truncated_frac"] + r["eos_frac"] == pytest.approx(1.0)  # every completion stopped or was cut
        assert r["completion_tokens"] == pytest.approx(r["completion_len_mean"] * r["samples"])
        assert r["completion_len_max"] == 160 or r["truncated_frac"] == 0
    assert any(r["truncated_frac"] > 0 for r in steps) and any(r["eos_frac"] > 0 for r in steps)
    alarm = TruncationAlarm(0.05, 2)
    due = [r["step"] for r in steps if alarm.update(r["truncated_frac"])]
    assert [w["step"] for w in records(run, "warning")] == due
    tb = EventAccumulator(str(run / "tensorboard" / "trainer"))
    tb.Reload()
    for tag in ("train_step/truncated_frac", "train_step/completion_len_mean", "train_step/eos_frac"):
        assert [e.step for e in tb.Scalars(tag)] == [r["step"] for r in steps]
    report = (run / "report.html").read_text()
    assert "Completion lengths and endings" in report and "Held-out replies" in report
    evals = [r for r in records(run, "eval") if r.get("replies")]
    assert evals and all(len(r["replies"]) == 6 for r in evals)  # actor.eval_samples
    last = evals[-1]["replies"][0]
    assert set(last) == {"prompt", "reply", "finish", "tokens", "label"}
    assert html.escape(visible(last["reply"])) in report  # model output, escaped
    summary = json.loads((run / "summary.json").read_text())[0]
    assert summary["warnings"] == len(due) and 0 <= summary["truncated_pct_last"] <= 100


@pytest.mark.parametrize("update_mode", ["keep", "interrupt"])
def test_pipelined_run(tiny_model_dir, tmp_path, update_mode):
    res = run_train(overrides(tiny_model_dir, tmp_path, "pipe", f"pipeline.update_mode={update_mode}"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "report:" in res.stdout
    steps = check_common(tmp_path / "pipe", 8)
    # in flight: weights changed under running sequences, so some sequences hold tokens of several versions
    assert sum(r["mixed_version_samples"] for r in steps) > 0
    # the staleness bound holds on every trained token, and data really was off-policy at times
    assert all(0 <= r["lag_min"] and r["lag_max"] <= 2 for r in steps)
    assert max(r["lag_max"] for r in steps) >= 1
    hist = {int(k) for r in steps for k in r["lag_hist"]}
    assert hist <= {0, 1, 2}
    pushes = records(tmp_path / "pipe", "weight_push")  # pushed after every step (logged once both servers had it)
    assert [r["step"] for r in pushes] == list(range(1, 9)) and all(r["push_s"] > 0 for r in pushes)


def test_sync_run_lag_pattern(tiny_model_dir, tmp_path):
    n = 3
    res = run_train(overrides(tiny_model_dir, tmp_path, "sync", "pipeline.mode=sync", f"pipeline.num_grad_steps={n}",
                              "pipeline.max_steps=6"))
    assert res.returncode == 0, res.stderr[-3000:]
    steps = check_common(tmp_path / "sync", 6)
    # the conventional loop: one round of n steps per weight version, lag 0, 1, ..., n-1 within each round
    assert [(r["lag_min"], r["lag_max"]) for r in steps] == [(k % n, k % n) for k in range(6)]
    assert sum(r["mixed_version_samples"] for r in steps) == 0  # weights never change under a sequence
    assert [r["step"] for r in records(tmp_path / "sync", "weight_push")] == [3, 6]  # once per round


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.mark.parametrize("how", ["kill_server", "ctrl_c"])
def test_killing_a_role_or_ctrl_c_stops_everything(tiny_model_dir, tmp_path, how):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = overrides(tiny_model_dir, tmp_path, "kill", "pipeline.max_steps=100000")
    # SIGINT back to its default in the child: a suite started in the background (`make test &`) runs with it ignored,
    # and the launcher would inherit that
    launcher = subprocess.Popen([sys.executable, "-m", "inflight.cli", "train", "/dev/null", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run = tmp_path / "kill"
    try:
        deadline = time.time() + 180
        while not (run / "metrics.jsonl").exists() or not records(run, "train_step"):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.time() < deadline, "no training step within 180 s"
            time.sleep(0.5)
        pids = records(run, "roles_started")[0]["pids"]
        assert set(pids) == {"server0", "server1", "trainer", "actor"}
        if how == "kill_server":
            os.kill(pids["server1"], signal.SIGKILL)
        else:
            launcher.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal delivers to the launcher
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    if how == "kill_server":
        assert launcher.returncode == 1
        assert "role 'server1' stopped unexpectedly (killed by signal 9)" in err
        failed = records(run, "role_failed")
        assert failed and failed[0]["failed_role"] == "server1"
    else:
        assert launcher.returncode == 130 and "interrupted" in err
        assert records(run, "interrupted")
    for name, pid in pids.items():
        deadline = time.time() + 10
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"{name} (pid {pid}) outlived the launcher"


@pytest.mark.parametrize("ranks,algo", [(1, []), (2, []), (2, ["algo.loss=decoupled_ppo", "algo.kl_coef=0.05",
                                                            "algo.advantage=reinforce_pp_baseline",
                                                            "algo.kl_reward_coef=0.05"])],
                         ids=["1-rank", "2-ranks", "2-ranks-decoupled_ppo-kl-reinforce_pp"])
def test_fsdp2_pipelined_run(tiny_model_dir, tmp_path, ranks, algo):
    """The FSDP2 launch path a multi-GPU user takes (trainer.num_processes ranks, rank 0 pushes), here on gloo. At
    world 1 too: FSDP2 gathers the pushed weights with collectives, which must not overlap a step's own. With
    decoupled PPO, the KL term and REINFORCE++-baseline's KL in the return (one run for all three: each costs a
    minute): pi_prox from the policy, the reference sharded on every rank, the step's statistics over the ranks."""
    res = run_train(overrides(tiny_model_dir, tmp_path, "fsdp", "trainer.backend=fsdp2",
                              f"trainer.num_processes={ranks}", "pipeline.max_steps=5", "actor.eval_every=0",
                              "actor.max_new_tokens=48", "algo.entropy_coef=1e-6", *algo))
    assert res.returncode == 0, res.stderr[-3000:]
    steps = records(tmp_path / "fsdp", "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and all(r["samples"] == 8 for r in steps)
    # step 1 trains on data of the starting weights: the trainer's logprobs (every rank's share) equal the servers'
    assert steps[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and steps[0]["ratio_max"] < 1.01
    if algo:  # the reference is the starting weights: no KL at step 1, some once the policy has moved
        assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[-1]["kl"] > 0
        # the same for the KL in the return, of the sampling policy (k1: of either sign; measured 1.5e-8 at step 1,
        # 3.5e-4 at most later)
        assert abs(steps[0]["kl_reward"]) < 1e-5 and max(abs(r["kl_reward"]) for r in steps[1:]) > 1e-5
    assert [r["step"] for r in records(tmp_path / "fsdp", "weight_push")] == [1, 2, 3, 4, 5]
    for k in (0, 1):
        assert [r["weight_version"] for r in records(tmp_path / "fsdp", "server_metrics") if r["server"] == k][-1] == 5


def test_pipelined_run_over_the_same_device_transport(tiny_model_dir, tmp_path):
    """trainer.weight_transport=cuda_ipc through `inflight train`: on CPU its stand-in, a shared-memory buffer that
    the trainer writes and both servers copy from."""
    res = run_train(overrides(tiny_model_dir, tmp_path, "ipc", "trainer.weight_transport=cuda_ipc",
                              "pipeline.max_steps=4"))
    assert res.returncode == 0, res.stderr[-3000:]
    check_common(tmp_path / "ipc", 4)
    pushes = records(tmp_path / "ipc", "weight_push")
    assert [r["step"] for r in pushes] == list(range(1, 5)) and all(r["push_s"] > 0 for r in pushes)
    for k in (0, 1):  # each server applied every update from the trainer's buffer
        log = (tmp_path / "ipc" / "logs" / f"server{k}.log").read_text()
        assert all(f"weight update v{v}: ipc, full" in log for v in range(1, 5)), log[-2000:]
