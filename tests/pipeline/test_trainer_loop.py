"""The trainer loop's own shortcuts change nothing but the work: zero-advantage samples are left out of the backward
with the same optimizer step as training them all, and a push that fails in the background stops the trainer. In
sync mode a round's training starts only once all of the round's groups are in. Truncated completions train or
not per algo.truncated (the gradient against a float64 hand computation), and every step logs lengths and endings."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from inflight.config import RunConfig
from inflight.config.trainer import TrainerConfig
from inflight.contracts import Sample
from inflight.report.metrics import MetricsLogger
from inflight.streams.memory import MemoryStream
from inflight.trainer.loop.trainer_loop import TrainerLoop
from inflight.trainer.single import SingleDeviceTrainer
from inflight.trainer.weight_sync.common import WeightSyncError
from tests.reliability.pipeline_helpers import records

torch.set_num_threads(1)
G, GPS = 4, 3


def groups(step: int, rewards: list[list[float]], rng: random.Random) -> list[list[Sample]]:
    """GPS groups of G samples with the given rewards, random prompts and completions, indices of `step`."""
    out = []
    for j, rs in enumerate(rewards):
        prompt = [rng.randrange(4, 60) for _ in range(5)]
        group = []
        for r in rs:
            n = rng.randint(2, 9)
            group.append(Sample(group_id=f"g{step}-{j}", prompt_ids=prompt,
                                completion_ids=[rng.randrange(4, 60) for _ in range(n)],
                                logprobs=[-rng.uniform(0.5, 3.0) for _ in range(n)], versions=[step - 1] * n,
                                reward=r, meta={"group_index": (step - 1) * GPS + j}))
        out.append(group)
    return out


def make_loop(model_dir, run_dir, float64: bool = False, **algo) -> TrainerLoop:
    cfg = RunConfig()
    cfg.actor.group_size, cfg.actor.groups_per_step = G, GPS
    cfg.pipeline.mode, cfg.pipeline.num_grad_steps = "sync", 1000  # no push within these steps
    cfg.pipeline.max_steps = len(STEPS)  # the sync round (cut to the run) is all of the steps' groups
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    policy = SingleDeviceTrainer(str(model_dir), TrainerConfig(threads=1, lr=1e-2, micro_batch_tokens=40))
    policy.init()
    if float64:  # in place: the optimizer keeps the same parameters
        policy.model.double()
    return TrainerLoop(cfg, policy, MemoryStream(), None, MetricsLogger(run_dir, "trainer"), run_dir)


STEPS = [  # rewards per group: mixed groups, all-right / all-wrong groups (advantage 0), then a step of only those
    [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]],
    [[0, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]],
    [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]],
]


@pytest.mark.parametrize("algo", [dict(loss="grpo"), dict(loss="ppo", normalization="tokens"),
                                  dict(loss="aipo", normalization="sequence_length")])
def test_zero_advantage_samples_skipped_with_the_same_update(tiny_model_dir, tmp_path, algo):
    # float64: the two sum the same gradients in another order, and Adam magnifies float32 rounding where the
    # gradient is near 0
    every = make_loop(tiny_model_dir, tmp_path / "a", float64=True, **algo)
    skipping = make_loop(tiny_model_dir, tmp_path / "b", float64=True, **algo)
    every.skip_zero_advantage = False
    assert skipping.skip_zero_advantage  # the default when the loss has no KL or entropy term
    before = {n: p.detach().clone() for n, p in every.policy.model.named_parameters()}
    for step, rewards in enumerate(STEPS, start=1):
        for loop in (every, skipping):
            loop.stream.put(groups(step, rewards, random.Random(step)))
    for step, rewards in enumerate(STEPS, start=1):
        a, b = every.step(), skipping.step()
        mixed = sum(len(set(rs)) > 1 for rs in rewards)
        assert a["trained_samples"] == G * GPS and b["trained_samples"] == G * mixed
        assert (a["lag_max"], a["tokens"], a["reward_mean"]) == (b["lag_max"], b["tokens"], b["reward_mean"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-12)
        for (n, p), q in zip(every.policy.model.named_parameters(), skipping.policy.model.parameters()):
            assert (q - p).abs().max().item() <= 1e-10, (n, step, (q - p).abs().max().item())
    # the last step had no advantage at all, and the weights still moved (Adam's momentum), the same way
    moved = max((p - before[n]).abs().max().item() for n, p in skipping.policy.model.named_parameters())
    assert moved > 1e-3


def test_kl_or_entropy_term_trains_every_sample(tiny_model_dir, tmp_path):
    assert not make_loop(tiny_model_dir, tmp_path / "a", entropy_coef=0.01).skip_zero_advantage
    assert not make_loop(tiny_model_dir, tmp_path / "b", kl_coef=0.1).skip_zero_advantage


class _FailingSync:
    urls: list[str] = []

    def push(self, named_weights, version, mode):
        raise WeightSyncError(f"no server took v{version} (HTTP 409)")


def test_a_failed_background_push_stops_the_trainer(tiny_model_dir, tmp_path):
    loop = make_loop(tiny_model_dir, tmp_path, loss="grpo")
    loop.cfg.pipeline.mode = "pipelined"
    loop.cfg.pipeline.weight_sync_retries = 0
    loop.sync = _FailingSync()
    loop.stream.put(groups(1, STEPS[0], random.Random(1)))
    loop.step()  # trains, then starts pushing v1 in the background
    with pytest.raises(RuntimeError, match="weight update to v1 failed.*no server took v1"):
        loop.step()  # waits for data that cannot come without v1 on the servers: the push's error ends the wait


class _RecordingSync:
    urls: list[str] = []

    def __init__(self):
        self.pushed: list[int] = []

    def push(self, named_weights, version, mode):
        self.pushed.append(version)
        return {}


def test_sync_round_trains_only_after_all_of_its_groups_are_generated(tiny_model_dir, tmp_path):
    loop = make_loop(tiny_model_dir, tmp_path, loss="grpo")
    loop.cfg.pipeline.num_grad_steps, loop.cfg.pipeline.max_steps = 2, 4
    loop.sync = _RecordingSync()
    rng = random.Random(0)
    for rnd in range(2):
        first = 2 * rnd + 1
        loop.stream.put(groups(first, STEPS[0], rng))  # half of the round
        done = threading.Event()
        t = threading.Thread(target=lambda: (loop.step(), done.set()), daemon=True)
        t.start()
        assert not done.wait(1.5), "trained before the round's second half was generated"
        assert loop.policy.version == 2 * rnd
        loop.stream.put(groups(first + 1, STEPS[1], rng))
        assert done.wait(60)
        t0 = time.monotonic()
        record = loop.step()  # the round's second step: its data is already in
        assert time.monotonic() - t0 < 30 and record["wait_s"] < 0.1
        loop.settle_push(block=True)
        assert loop.policy.version == first + 1 and loop.sync.pushed == list(range(2, first + 2, 2))
    assert [r["step"] for r in records(tmp_path, "weight_push")] == [2, 4]


# ---- truncated completions (algo.truncated) -------------------------------------------------------------------

CUT = {(0, 1), (0, 3), (1, 0), (2, 2)}  # (group, sample) cut off by the length limit in the handmade step


def truncated_step(rng: random.Random) -> list[list[Sample]]:
    out = groups(1, [[1, 0, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], rng)
    for j, k in CUT:
        out[j][k].finish_reason = "length"
    return out


def hand_gradient(model_dir, weights: dict, step_groups, mode: str) -> dict[str, torch.Tensor]:
    """Plain float64 reference of the grpo step: every sample alone through an HF model with the loop's starting
    weights, A = r - mean(group) over all of its group, w = min(pi/mu, 5), loss = -sum A w log pi / N_seq over the
    completion tokens of the samples that train in `mode` (all but the cut-off ones under mask)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in weights.items()})
    n_seq = sum(len(g) for g in step_groups)
    loss = torch.zeros((), dtype=torch.float64)
    for g in step_groups:
        mean = sum(s.reward for s in g) / len(g)
        for s in g:
            if mode == "mask" and s.finish_reason == "length":
                continue
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = ref(input_ids=ids).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0][len(s.prompt_ids) - 1:]
            mu = torch.tensor(s.logprobs, dtype=torch.float32).double()  # a TrainBatch carries mu in float32
            w = torch.exp(lp - mu).detach().clamp(max=5.0)
            loss = loss - ((s.reward - mean) * w * lp).sum() / n_seq
    loss.backward()
    return {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("mode", ["mask", "keep", "zero_reward", "soft_penalty"])
def test_truncated_completions_train_per_mode(tiny_model_dir, tmp_path, mode):
    """mask: the cut-off samples' tokens do not train (their rewards still set their groups' baselines); the reward
    modes train every sample like keep (their effect is on the rewards, tests/rewards)."""
    loop = make_loop(tiny_model_dir, tmp_path, float64=True, loss="grpo", truncated=mode)
    loop.cfg.pipeline.max_steps = 1  # the sync round: this step's groups
    step_groups = truncated_step(random.Random(7))
    start = {k: v.clone() for k, v in loop.policy.model.state_dict().items()}
    expected = hand_gradient(tiny_model_dir, start, step_groups, mode)
    grads = {}
    take_step = loop.policy.optimizer_step

    def capture():
        grads.update({n: p.grad.clone() for n, p in loop.policy.model.named_parameters()})
        return take_step()

    loop.policy.optimizer_step = capture
    loop.stream.put(step_groups)
    rec = loop.step()
    for n, g in expected.items():  # HF's RMSNorm computes in float32 even in a float64 model: ~1e-7 relative
        err, scale = (grads[n] - g).abs().max().item(), g.abs().max().item()
        assert err <= 1e-6 * scale + 1e-12, (n, err, scale)
    if mode == "mask":  # the cut-off samples' tokens would have changed the gradient by far more than that
        keep = hand_gradient(tiny_model_dir, start, step_groups, "keep")
        assert max((keep[n] - g).abs().max().item() / g.abs().max().item() for n, g in expected.items()) > 1e-2
    samples = [s for g in step_groups for s in g]
    masked = [s for s in samples if mode == "mask" and s.finish_reason == "length"]
    assert rec["masked_samples"] == len(masked)
    assert rec["tokens"] == sum(len(s.completion_ids) for s in samples) - sum(len(s.completion_ids) for s in masked)
    # lengths and endings of all samples, masked or not
    lengths = [len(s.completion_ids) for s in samples]
    assert (rec["completion_len_mean"], rec["completion_len_min"], rec["completion_len_max"]) == (
        pytest.approx(sum(lengths) / len(lengths)), min(lengths), max(lengths))
    assert rec["truncated_frac"] == pytest.approx(len(CUT) / len(samples))
    assert rec["eos_frac"] == pytest.approx(1 - len(CUT) / len(samples))
    ended = [len(s.completion_ids) for s in samples if s.finish_reason == "stop"]
    assert rec["terminated_len_mean"] == pytest.approx(sum(ended) / len(ended))
    assert rec["completion_tokens"] == sum(lengths) and rec["prompt_tokens"] == 5 * GPS
    # the trainer ran each group's prompt once per micro-batch: at most every prompt once per sample, at least once
    trained = [s for s in samples if s not in masked]
    least = 5 * GPS + sum(len(s.completion_ids) for s in trained)
    assert least <= rec["trainer_tokens"] <= sum(len(s) for s in trained)


def test_a_step_of_only_masked_samples_still_steps(tiny_model_dir, tmp_path):
    loop = make_loop(tiny_model_dir, tmp_path, loss="grpo", truncated="mask")
    loop.cfg.pipeline.max_steps = 2
    rng = random.Random(3)
    loop.stream.put(truncated_step(rng))
    every_cut = groups(2, STEPS[0], rng)
    for g in every_cut:
        for s in g:
            s.finish_reason = "length"
    loop.stream.put(every_cut)  # the sync round holds both steps' groups
    loop.step()
    grads = {}
    take_step = loop.policy.optimizer_step
    loop.policy.optimizer_step = lambda: (grads.update({n: p.grad.clone() for n, p in
                                                        loop.policy.model.named_parameters()}), take_step())[1]
    before = {n: p.detach().clone() for n, p in loop.policy.model.named_parameters()}
    rec = loop.step()
    assert rec["masked_samples"] == G * GPS and rec["trained_samples"] == 0 and rec["tokens"] == 0
    assert rec["truncated_frac"] == 1.0 and rec["eos_frac"] == 0.0
    assert all(g is not None and g.abs().max().item() == 0.0 for g in grads.values())  # a gradient, all zeros
    moved = max((p - before[n]).abs().max().item() for n, p in loop.policy.model.named_parameters())
    assert moved > 1e-4  # Adam's momentum from the first step, as with any step without signal


def test_truncation_warning_after_a_streak(tiny_model_dir, tmp_path):
    from inflight.trainer.loop.completions import TruncationAlarm

    alarm = TruncationAlarm(threshold=0.5, steps=3)
    fired = [alarm.update(f) is not None for f in [0.9, 0.9, 0.4, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.5]]
    assert fired == [False, False, False, False, False, True, False, False, True, False]
    assert TruncationAlarm(0.5, 0).update(1.0) is None
    loop = make_loop(tiny_model_dir, tmp_path, loss="grpo")
    loop.cfg.pipeline.max_steps = 1
    loop.alarm = TruncationAlarm(threshold=0.2, steps=1)
    loop.stream.put(truncated_step(random.Random(1)))
    loop.step()  # 4 of 12 cut off: above 20%
    (warning,) = records(tmp_path, "warning")
    assert warning["kind"] == "truncation" and warning["step"] == 1 and "33%" in warning["message"]
