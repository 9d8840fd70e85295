"""A weight update that fails half-way (one server rejects it, or is down) leaves every server on one complete
version, and the trainer retries (forming the weight group again) or stops with an error naming the server and
every server's version. Real `inflight serve` processes, real gloo group, the TrainerLoop's own push."""

from __future__ import annotations

import os
import signal

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
from tests.reliability.pipeline_helpers import records

pytestmark = pytest.mark.slow  # two server start-ups per test (~45 s together on 2 shared cores)
torch.set_num_threads(1)
SERVE = ["--threads", "1", "--max-batch", "8"]


def version(url: str) -> int:
    return httpx.get(url + "/health", timeout=5).json()["version"]


def greedy(url: str) -> list[int]:
    body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "12+34="}], "logprobs": True}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["token_ids"]


def make_loop(tiny_model_dir, tmp_path, urls: list[str], retries: int) -> TrainerLoop:
    cfg = RunConfig()
    cfg.pipeline.weight_sync_retries, cfg.pipeline.startup_timeout_s = retries, 3.0
    policy = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(threads=1))
    policy.init()
    with torch.no_grad():  # new weights, so that an applied update is visible in the outputs
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sync = WeightSyncClient(urls, timeout_s=30.0)
    sync.init_process_group()
    return TrainerLoop(cfg, policy, None, sync, MetricsLogger(tmp_path, "trainer"), tmp_path)


@pytest.fixture
def other_shape_model(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    out = tmp_path_factory.mktemp("other_shape")
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.intermediate_size = 96
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def test_rejected_update_changes_no_server(tiny_model_dir, other_shape_model, tmp_path):
    with ServerProcess(str(tiny_model_dir), extra_args=SERVE) as a, \
            ServerProcess(str(other_shape_model), extra_args=SERVE) as b:
        before = greedy(a.url)
        loop = make_loop(tiny_model_dir, tmp_path, [a.url, b.url], retries=3)
        try:
            with pytest.raises(RuntimeError) as exc:
                loop.push(1)
        finally:
            loop.sync.close()
        msg = str(exc.value)
        assert "after 1 attempt(s)" in msg and b.url in msg and "HTTP 400" in msg and "shape" in msg
        assert f"'{a.url}': 0" in msg and f"'{b.url}': 0" in msg  # the versions, in the message
        assert version(a.url) == version(b.url) == 0 and greedy(a.url) == before  # nothing applied anywhere
        assert not records(tmp_path, "weight_sync_retry")  # a rejection is not retried


def test_server_down_then_back(tiny_model_dir, tmp_path):
    a = ServerProcess(str(tiny_model_dir), extra_args=SERVE)
    b = ServerProcess(str(tiny_model_dir), extra_args=SERVE)
    loop = make_loop(tiny_model_dir, tmp_path, [a.url, b.url], retries=1)
    try:
        loop.push(1)
        assert version(a.url) == version(b.url) == 1
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.wait()
        with pytest.raises(RuntimeError) as exc:  # down for good: retried, then a clear stop
            loop.push(2)
        msg = str(exc.value)
        assert "after 2 attempt(s)" in msg and f"'{b.url}': 'down'" in msg and f"'{a.url}': 1" in msg
        assert version(a.url) == 1  # the surviving server did not move on alone
        assert len(records(tmp_path, "weight_sync_retry")) >= 1

        b = ServerProcess(str(tiny_model_dir), port=b.port, extra_args=SERVE)  # back, on its old address
        loop.policy.version = 2
        loop.push(2)  # first attempt fails (b is in no group), the retry forms the group again
        assert version(a.url) == version(b.url) == 2
        assert greedy(a.url) == greedy(b.url)  # the same complete weights on both
    finally:
        loop.sync.close()
        a.stop()
        b.stop()
