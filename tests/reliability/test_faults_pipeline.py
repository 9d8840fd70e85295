"""Faults while the pipeline runs (real processes): an inference server is SIGKILLed and restarted by the launcher
(`pipeline.restart_servers=true`), and the trainer stalls (SIGSTOP). The run never stops; the restarted server
serves only once it holds the current weights; during the stall the actor stops at the staleness bound, the
servers stay healthy and nothing queues up."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from inflight.config.actor import ActorConfig
from tests.reliability.pipeline_helpers import base_overrides, latest_step, launch, records, wait_for

pytestmark = pytest.mark.slow

STEPS, GPS, G, MAX_LAG = 40, 2, 4, 1  # enough steps that the stall comes well before the actor's last group
AHEAD = ActorConfig().queue_ahead  # steps of groups sent early, held by the (gated) servers


def health(url: str) -> tuple[int | None, int | None]:
    """(HTTP status or None when refused, version when 200)."""
    try:
        r = httpx.get(url + "/health", timeout=1.0)
        return r.status_code, (r.json().get("version") if r.status_code == 200 else None)
    except httpx.HTTPError:
        return None, None


def server_load(url: str) -> float:
    """Sequences running + waiting on a server, from its Prometheus /metrics."""
    text = httpx.get(url + "/metrics", timeout=2.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("inflight_running", "inflight_waiting", "inflight_num_running", "inflight_num_waiting")):
            total += float(line.split()[-1])
    return total


def test_server_restart_and_trainer_stall(tiny_model_dir, tmp_path):
    run = tmp_path / "faults"
    args = base_overrides(tiny_model_dir, tmp_path, "faults", f"pipeline.max_steps={STEPS}",
                          "pipeline.restart_servers=true", "actor.metrics_interval_s=0.3",
                          "pipeline.scrape_every_s=0.5")
    base = int(next(a for a in args if a.startswith("server.base_port=")).split("=")[1])
    urls = [f"http://127.0.0.1:{base + k}" for k in (0, 1)]
    p = launch(["/dev/null", *args])
    try:
        wait_for(lambda: latest_step(run) >= 2, p, 120, "step 2")
        pids = records(run, "roles_started")[-1]["pids"]

        # (a) SIGKILL server1: the launcher restarts it; it answers 503/refused until the trainer gave it the
        # current weights, then 200 with a version at least that of the trainer when it died
        os.kill(pids["trainer"], signal.SIGSTOP)  # steps take < 0.1 s: hold the trainer so the kill lands mid-run
        try:
            killed_at = latest_step(run)
            assert killed_at < STEPS
            os.kill(pids["server1"], signal.SIGKILL)
        finally:
            os.kill(pids["trainer"], signal.SIGCONT)
        seen: list[tuple[int | None, int | None]] = []
        deadline = time.time() + 90
        while time.time() < deadline:
            seen.append(health(urls[1]))
            if seen[-1][0] == 200 and records(run, "server_restart"):
                break
            assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.1)
        assert seen[-1][0] == 200, f"server1 not back: {seen[-5:]}"
        assert {s for s, _ in seen[:-1]} <= {None, 503, 200} and (None in {s for s, _ in seen} or 503 in
                                                                   {s for s, _ in seen})
        first_version = seen[-1][1]
        assert first_version >= killed_at, (first_version, killed_at)  # never served the initial weights
        assert not [s for s in seen if s[0] == 200 and s[1] is not None and s[1] < killed_at]
        restart = records(run, "server_restart")
        assert restart[0]["server"] == 1 and restart[0]["exit_code"] == -9

        # (b) stall the trainer: the actor fills the bound and waits; servers stay healthy and go idle
        wait_for(lambda: latest_step(run) >= first_version + 1, p, 60, "a step after the restart")
        trainer_pid = records(run, "roles_started")[-1]["pids"]["trainer"]
        os.kill(trainer_pid, signal.SIGSTOP)
        try:
            time.sleep(1.0)
            trained = latest_step(run)  # the trainer's version can no longer change
            # the run's last group must lie beyond the bound, or the actor simply finishes and stops reporting
            assert (trained + MAX_LAG + 1 + AHEAD) * GPS < STEPS * GPS, f"stalled too late (step {trained} of {STEPS})"
            samples = []
            t_end = time.time() + 4.0
            while time.time() < t_end:
                assert all(health(u)[0] == 200 for u in urls)
                samples.append(max(server_load(u) for u in urls))
                time.sleep(0.3)
            actor = [r for r in records(run, "actor") if r["time"] > t_end - 4.0]
        finally:
            os.kill(trainer_pid, signal.SIGCONT)
        assert actor, "no actor report during the stall"
        # the version the actor's bound uses: published once the servers hold it, so the last step's push may have
        # been in flight when the trainer stopped; or published before the step's metrics line was written
        version = actor[-1]["trainer_version"]
        assert version in (trained - 1, trained, trained + 1) and all(r["trainer_version"] == version for r in actor)
        bound = (version + MAX_LAG + 1 + AHEAD) * GPS
        live = [r["groups_started"] - r["groups_failed"] for r in actor]
        assert max(live) <= bound, (live, bound)
        assert live[-1] == bound  # it went up to the bound ...
        late = [x for r, x in zip(actor, live) if r["time"] > t_end - 2.0]
        assert late and set(late) == {bound}  # ... and then waited: nothing started in the last 2 s of the stall
        # (groups_in_flight may stay > 0 for a while: a request that met the dead server waits in its retry backoff)
        # servers never hold more than the bound's sequences, and their load does not grow while the trainer is
        # stopped (what remains are the queued-ahead requests, held for weights the stopped trainer has not sent)
        assert max(samples) <= (MAX_LAG + 1 + AHEAD) * GPS * G and samples[-1] <= max(samples[:2]), samples

        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["samples_total"] for r in steps] == [G * GPS * s for s in range(1, STEPS + 1)]
    assert all(r["lag_max"] <= MAX_LAG for r in steps)
    assert records(run, "weight_sync_retry"), "the trainer should have re-formed the weight group"
    assert not records(run, "role_failed")
    last = {k: [r["weight_version"] for r in records(run, "server_metrics") if r["server"] == k][-1] for k in (0, 1)}
    assert last == {0: STEPS, 1: STEPS}
