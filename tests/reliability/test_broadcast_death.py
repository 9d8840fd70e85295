"""A server SIGKILLed in the middle of a weight broadcast (after the dry run passed): the push fails within seconds
naming it, not after the group timeout; the surviving server leaves the broadcast at once, drops the half-received
update and serves the OLD weights again; once the dead server is back, the next push brings both to the new version.
Real `inflight serve` processes, real gloo group (WeightSyncClient timeout_s=600), the TrainerLoop's own push."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import torch

from inflight.config import RunConfig
from inflight.config.trainer import TrainerConfig
from inflight.engine.serve import ServerProcess
from inflight.report.metrics import MetricsLogger
from inflight.trainer.loop.trainer_loop import TrainerLoop
from inflight.trainer.single import SingleDeviceTrainer
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from tests.reliability.test_weight_update_faults import SERVE, greedy, version

pytestmark = pytest.mark.slow  # three server start-ups (~35 s on 2 shared cores)
torch.set_num_threads(1)
GROUP_TIMEOUT_S = 600.0  # the default: without the abort, the survivor would wait this long inside the broadcast
BOUND_S = 60.0  # every recovery step must end far below the group timeout


class KillDuringBroadcast:
    """The trainer's group, with a hook: SIGKILL a server once `after` tensors were broadcast (the dry run passed
    and every server was asked to receive). The test keeps no reference to it, so aborting the group frees it."""

    def __init__(self, group, pid: int, after: int, marks: dict):
        self.group, self.pid, self.after, self.marks, self.sent = group, pid, after, marks, 0

    def broadcast(self, tensors, opts):
        work = self.group.broadcast(tensors, opts)
        self.sent += 1
        if self.sent == self.after:
            work.wait()
            os.kill(self.pid, signal.SIGKILL)
            self.marks["killed"] = time.monotonic()
        return work


def run_with_deadline(fn, seconds: float) -> tuple[object, BaseException | None, float]:
    """fn() on a thread; (result, error, seconds). A call still blocked after `seconds` fails the test."""
    box: dict = {}

    def target() -> None:
        try:
            box["res"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["err"] = exc

    t0 = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds:.0f} s (group timeout {GROUP_TIMEOUT_S:.0f} s)"
    return box.get("res"), box.get("err"), time.monotonic() - t0


def make_loop(model_dir, run_dir, urls: list[str], bucket_bytes: int = 0) -> TrainerLoop:
    cfg = RunConfig()
    cfg.pipeline.weight_sync_retries, cfg.pipeline.startup_timeout_s = 2, 3.0
    policy = SingleDeviceTrainer(str(model_dir), TrainerConfig(threads=1))
    policy.init()
    with torch.no_grad():  # new weights, so that an applied update is visible in the outputs
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sync = WeightSyncClient(urls, timeout_s=GROUP_TIMEOUT_S, bucket_bytes=bucket_bytes)
    sync.init_process_group()
    return TrainerLoop(cfg, policy, None, sync, MetricsLogger(run_dir, "trainer"), run_dir)


def token_versions(url: str) -> list[int]:
    body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "12+34="}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["token_versions"]


@pytest.mark.parametrize("prepared", [False, True], ids=["per_tensor", "prepared_buckets"])
def test_server_killed_mid_broadcast(tiny_model_dir, tmp_path, prepared):
    """prepared: the FSDP2 loop's form of the push, packed in buckets (norms share one) once and sent as it is."""
    a = ServerProcess(str(tiny_model_dir), extra_args=SERVE)
    b = ServerProcess(str(tiny_model_dir), extra_args=SERVE)
    loop = make_loop(tiny_model_dir, tmp_path, [a.url, b.url], bucket_bytes=4096 if prepared else 0)

    def weights():
        return loop.sync.prepare(loop.policy.named_weights()) if prepared else loop.policy.named_weights()

    try:
        old = greedy(a.url)
        assert greedy(b.url) == old and version(a.url) == version(b.url) == 0
        ntensors = len(list(loop.policy.named_weights()))
        assert ntensors > 6
        marks: dict = {}
        loop.sync.group = KillDuringBroadcast(loop.sync.group, b.proc.pid, after=3, marks=marks)

        # 1. The push fails fast and names the dead server.
        _, err, _ = run_with_deadline(lambda: loop.sync.push(weights(), 1), BOUND_S)
        failed_after = time.monotonic() - marks["killed"]
        b.proc.wait()
        assert err is not None and b.url in str(err), err
        assert "broadcast" in str(err) and "weight group aborted" in str(err)
        # the survivor's own answer: it left the broadcast and applied nothing
        assert f"server {a.url} rejected /request_weight_update (HTTP 409)" in str(err)
        assert "nothing applied" in str(err)
        print(f"\npush error: {err}")

        # 2. The survivor left the broadcast, dropped what it had received and serves the old weights.
        out, err2, _ = run_with_deadline(lambda: greedy(a.url), BOUND_S)
        survivor_after = time.monotonic() - marks["killed"]
        assert err2 is None, f"the surviving server does not answer (still inside the broadcast?): {err2!r}"
        assert version(a.url) == 0 and out == old  # no half-new weights
        assert set(token_versions(a.url)) == {0}  # and it keeps serving: every new token from version 0
        log = open(a.log_path).read()
        assert "broke off" in log and "nothing applied" in log  # it was inside the broadcast and dropped it

        # 3. The dead server comes back: the trainer's push re-forms the group and both reach v1.
        t0 = time.monotonic()
        b = ServerProcess(str(tiny_model_dir), port=b.port, extra_args=SERVE)
        restart_s = time.monotonic() - t0
        _, err, push_s = run_with_deadline(lambda: loop.push(1, weights() if prepared else None), BOUND_S)
        assert err is None, err
        assert version(a.url) == version(b.url) == 1
        new = greedy(a.url)
        assert greedy(b.url) == new and new != old  # the same complete new weights on both
        print(f"\nbroadcast death: push failed {failed_after:.2f} s after the kill, survivor served old weights "
              f"{survivor_after:.2f} s after it; server restart {restart_s:.1f} s, recovery push {push_s:.2f} s "
              f"(group timeout {GROUP_TIMEOUT_S:.0f} s, {ntensors} tensors)")
    finally:
        loop.sync.close()
        a.stop()
        b.stop()
