"""Checkpoints: contents, atomic write, pruning, and that a resumed trainer continues bit-for-bit where the
uninterrupted one goes (optimizer moments, scheduler and RNG states included)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer.loop import checkpoint as ckpt
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.single import SingleDeviceTrainer
from tests.trainer.helpers import ReinforceLoss, random_samples

torch.set_num_threads(1)
CFG = TrainerConfig(lr=1e-2, schedule="cosine", warmup_steps=2, total_steps=10, threads=1)


def train_step(engine: SingleDeviceTrainer, seed: int) -> None:
    samples = random_samples(8, vocab=40, seed=seed)
    adv = [random.Random(seed + k).uniform(-1, 1) for k in range(8)]
    for mb in pack_samples(samples, adv, 256, len(samples), count_loss_tokens(samples)):
        engine.backward(mb, ReinforceLoss())
    engine.optimizer_step()


def state(step: int, **kw) -> ckpt.CheckpointState:
    return ckpt.CheckpointState(step=step, version=step, samples_trained=8 * step, next_group=2 * step + 1,
                                skipped_groups=[1], groups_per_step=2, group_size=4, seed=0, **kw)


def weights(engine: SingleDeviceTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_resumed_trainer_matches_uninterrupted(tiny_model_dir, tmp_path):
    a = SingleDeviceTrainer(str(tiny_model_dir), CFG)
    a.init()
    for s in range(3):
        train_step(a, s)
    torch.manual_seed(1234)
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", "step_000003", a, state(3))
    draw_a = torch.rand(4)  # the RNG stream continues from the checkpoint
    for s in range(3, 5):
        train_step(a, s)

    b = SingleDeviceTrainer(str(path), CFG)  # weights from the checkpoint folder (HF format)
    b.init()
    torch.manual_seed(999)
    st = ckpt.restore_trainer(b, path)
    assert torch.equal(torch.rand(4), draw_a)
    assert (st.step, st.version, st.samples_trained, st.next_group, st.skipped_groups) == (3, 3, 24, 7, [1])
    assert b.version == 3 and b.scheduler.last_epoch == 3
    for s in range(3, 5):
        train_step(b, s)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert b.version == a.version == 5

    # without the optimizer/scheduler state the same two steps give different weights (the test can fail)
    c = SingleDeviceTrainer(str(path), CFG)
    c.init()
    c.version = 3
    for s in range(3, 5):
        train_step(c, s)
    assert any(not torch.equal(wa[k], v) for k, v in weights(c).items())


def test_checkpoint_contents_loadable(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    e = SingleDeviceTrainer(str(tiny_model_dir), CFG)
    e.init()
    train_step(e, 0)
    path = ckpt.save_checkpoint(tmp_path, "step_000001", e, state(1))
    m = AutoModelForCausalLM.from_pretrained(path)
    for k, v in m.state_dict().items():
        assert torch.equal(v, e.model.state_dict()[k])
    assert AutoTokenizer.from_pretrained(path)("1+2")["input_ids"]
    extra = torch.load(path / ckpt.TRAIN_STATE, weights_only=True)  # no pickle of arbitrary objects needed
    assert set(extra) >= {"optimizer", "scheduler", "rng"}
    assert json.loads((path / ckpt.STATE_JSON).read_text())["next_group"] == 3


def test_atomic_write_and_pruning(tiny_model_dir, tmp_path, monkeypatch):
    e = SingleDeviceTrainer(str(tiny_model_dir), CFG)
    e.init()
    root = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        ckpt.save_checkpoint(root, f"step_{s:06d}", e, state(s), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000006"]
    ckpt.save_checkpoint(root, "final", e, state(7), keep=2)
    assert ckpt.latest_checkpoint(tmp_path).name == "final"

    # a crash while writing (here: the state file cannot be written) leaves the previous checkpoints untouched
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "rng_state", boom)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(root, "step_000008", e, state(8), keep=2)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["final", "step_000004", "step_000006"]
    assert ckpt.latest_checkpoint(tmp_path).name == "final"
    # a half-written folder without state.json (as after SIGKILL mid-write) never counts
    (root / "step_000009").mkdir()
    (root / "step_000009" / "config.json").write_text("{}")
    assert ckpt.latest_checkpoint(tmp_path).name == "final"
    # SIGKILL between creating the temporary folder's state.json and writing it (seen in the Ray resume test):
    # the save in progress never counts, though its state file exists
    (root / ".tmp-step_000010-0123abcd").mkdir()
    (root / ".tmp-step_000010-0123abcd" / ckpt.STATE_JSON).write_text("")
    (root / ".old-final-4567ef01").mkdir()
    (root / ".old-final-4567ef01" / ckpt.STATE_JSON).write_text("")
    assert ckpt.latest_checkpoint(tmp_path).name == "final"


def fake_checkpoint(root: Path, name: str, step: int | None) -> None:
    """A folder as a save leaves it, weights left out (choosing one reads state.json only); `step=None`: a folder
    without state.json, as a crash mid-write leaves one."""
    (root / name).mkdir(parents=True)
    (root / name / "config.json").write_text("{}")
    if step is not None:
        (root / name / ckpt.STATE_JSON).write_text(json.dumps(ckpt.asdict(state(step))))


def test_the_newest_of_many_checkpoints_is_the_one_resumed(tmp_path):
    """Steps past 999999 outgrow the zero padding, so their names sort before lower steps' as strings: the newest
    is chosen by the step state.json records. Half-written and hidden folders never count, whatever their step."""
    root = tmp_path / "checkpoints"
    for s in (2, 9, 10, 999_998, 999_999, 1_000_000):
        fake_checkpoint(root, f"step_{s:06d}", s)
    fake_checkpoint(root, "final", 500)  # a "final" of an earlier, shorter run
    fake_checkpoint(root, "step_1000001", None)  # SIGKILL mid-write
    fake_checkpoint(root, ".tmp-step_1000002-0123abcd", 1_000_002)  # a save in progress
    fake_checkpoint(root, ".old-final-4567ef01", 1_000_003)  # a replaced final being removed
    names = sorted(p.name for p in root.iterdir())
    assert max(n for n in names if n.startswith("step_")) == "step_999999"  # what a name sort would pick
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_1000000"
    assert ckpt.read_state(root / "step_1000000").step == 1_000_000

    fake_checkpoint(root, "step_1000004", 1_000_004)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_1000004"
    ckpt.prune(root, keep=2)  # the two newest steps stay, "final" is never pruned, the save in progress goes
    assert sorted(p.name for p in root.iterdir()) == [
        ".old-final-4567ef01", "final", "step_1000000", "step_1000001", "step_1000004"]
    (root / "final" / ckpt.STATE_JSON).write_text(json.dumps(ckpt.asdict(state(1_000_004))))
    assert ckpt.latest_checkpoint(tmp_path).name == "step_1000004"  # same step: the step folder
    (root / "final" / ckpt.STATE_JSON).write_text(json.dumps(ckpt.asdict(state(1_000_005))))
    assert ckpt.latest_checkpoint(tmp_path).name == "final"


def test_resume_refuses_a_different_prompt_layout():
    from inflight.config import RunConfig

    cfg = RunConfig()
    cfg.actor.groups_per_step, cfg.actor.group_size = 2, 4
    ckpt.check_compatible(state(2), cfg)
    cfg.actor.groups_per_step = 3
    with pytest.raises(ValueError, match="groups_per_step"):
        ckpt.check_compatible(state(2), cfg)


def test_actor_rebased_on_resume(tiny_model_dir):
    """The staleness bound right after a resume: the actor's counters start at the checkpoint, it continues the
    prompt order at prompt `next_group`, and nothing starts before the checkpoint's version is published."""
    from inflight.actor.actor import Actor
    from inflight.config.actor import ActorConfig
    from inflight.config.tasks import TaskConfig
    from inflight.tasks import get_task

    task = get_task(TaskConfig(name="arith", eval_size=8))
    cfg = ActorConfig(groups_per_step=2, group_size=2, max_lag=1)
    fresh = task.train_samples(0)
    prompts = [next(fresh).id for _ in range(12)]
    actor = Actor(cfg, task, pool=None, rewards=None, stream=None, seed=0, first_group=7, groups_given_up=1,
                  min_version=3)  # type: ignore[arg-type]
    assert next(actor.prompts).id == prompts[7]
    assert actor.live_groups == 6  # = groups trained by version 3 (3 steps x 2)
    assert actor.metrics.in_flight == 0
    assert actor.bound(3) - actor.live_groups == (cfg.max_lag + 1 + cfg.queue_ahead) * cfg.groups_per_step
    assert actor.min_version == 3
