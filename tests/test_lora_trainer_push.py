"""A LoRA trainer's pushes to `inflight serve` (subprocess) over every transport of WeightSyncClient: the update is
the adapter alone (its bytes), the server's version advances, and the server's logprobs of its own completion
equal the trainer's forward logprobs (adapter unmerged in the trainer, merged in the engine)."""

from __future__ import annotations

import httpx
import pytest
import torch

from inflight.config.trainer import LoraConfig, TrainerConfig
from inflight.contracts import Sample
from inflight.trainer.packing import pack_samples
from inflight.trainer.single import SingleDeviceTrainer
from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from tests.servers import serve_model
from tests.trainer.helpers import ReinforceLoss, random_samples

torch.set_num_threads(1)
MSG = [{"role": "user", "content": "3+4="}]
RANK = 4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(lr=3e-2, max_grad_norm=1e9,
                                                               lora=LoraConfig(rank=RANK, alpha=8.0)))
    t.init()
    return t


def _step(t: SingleDeviceTrainer, seed: int) -> None:
    samples = random_samples(8, t.model.config.vocab_size, seed=seed)
    adv = [float(i % 3) - 1.0 for i in range(8)]
    for mb in pack_samples(samples, adv, 80, 8, sum(len(s.completion_ids) for s in samples)):
        t.backward(mb, ReinforceLoss())
    t.optimizer_step()


def _chat(url: str) -> dict:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": model, "messages": MSG, "max_tokens": 12, "logprobs": True, "ignore_eos": True,
        "temperature": 1.0, "seed": 3}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _trainer_logprobs(t: SingleDeviceTrainer, choice: dict) -> list[float]:
    prompt, completion = choice["prompt_token_ids"], choice["token_ids"]
    s = Sample(group_id="g", prompt_ids=prompt, completion_ids=completion, logprobs=[0.0] * len(completion),
               versions=[0] * len(completion))
    (mb,) = pack_samples([s], [0.0], 4096, 1, len(completion))
    return t.forward_logprobs(mb)[len(prompt):].tolist()


@pytest.mark.slow  # ~15 s: a server subprocess, four pushes
def test_adapter_pushes_on_every_transport_serve_the_trainers_model(server, trainer, tiny_model_dir, tmp_path):
    n_adapter = sum(t.numel() * 4 for _, t in trainer.named_weights())
    n_full = sum(p.numel() * 4 for p in trainer.model.parameters())
    assert n_adapter * 10 < n_full
    version = 0
    for transport, bucket in (("process_group", 0), ("process_group", 1 << 20), ("shm", 0), ("file", 0)):
        _step(trainer, seed=version)
        version += 1
        client = WeightSyncClient([server.url], transport=transport, bucket_bytes=bucket, timeout_s=60,
                                  shm_dir=str(tmp_path))
        try:
            client.init_process_group()
            res = client.push(trainer.named_weights(), version, adapter=trainer.adapter)
        finally:
            client.close()
        assert res["adapter"] and res["bytes"] == n_adapter, transport
        assert httpx.get(server.url + "/health").json()["version"] == version
        choice = _chat(server.url)
        assert set(choice["token_versions"]) == {version}
        got = [e["logprob"] for e in choice["logprobs"]["content"]]
        want = _trainer_logprobs(trainer, choice)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (transport, got, want)
    base = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig())
    base.init()
    moved = max(abs(a - b) for a, b in zip(got, _trainer_logprobs(base, choice)))
    assert moved > 1e-2, moved  # the served logprobs are the adapter's, not the base's


def test_a_malformed_adapter_push_is_refused_before_sending(trainer):
    client = WeightSyncClient(["http://127.0.0.1:9"], transport="file")  # nothing is posted: refused first
    try:
        tensors = list(trainer.named_weights())
        with pytest.raises(WeightSyncError, match="not an adapter update"):
            client.push(tensors[:-1], 1, adapter=trainer.adapter)  # the last lora_B missing
        with pytest.raises(WeightSyncError, match="do not have rank 3"):
            client.push(tensors, 1, adapter={"rank": 3, "scaling": 1.0})
    finally:
        client.close()


@pytest.mark.slow  # ~8 s: a second server subprocess
def test_serve_starts_from_the_trainers_saved_adapter(trainer, tiny_model_dir, tmp_path):
    """The checkpoint format (PEFT's) is what `inflight serve --adapter` reads: that server serves the trainer's
    model from its first token."""
    from inflight.engine.serve import ServerProcess

    _step(trainer, seed=11)
    trainer.save(str(tmp_path / "ckpt"))
    with ServerProcess(str(tiny_model_dir), extra_args=["--max-model-len", "512", "--adapter", str(tmp_path / "ckpt")],
                       env={"OMP_NUM_THREADS": "1"}) as srv:
        choice = _chat(srv.url)
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    want = _trainer_logprobs(trainer, choice)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
