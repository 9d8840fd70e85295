"""Trainer checkpoints: everything a run needs to continue where it was, written atomically.

    runs/<name>/checkpoints/step_000012/
        config.json, model.safetensors, tokenizer...  the weights, HF format (AutoModelForCausalLM.from_pretrained)
                            or, with trainer.lora, adapter_config.json + adapter_model.safetensors: the adapter
                            in PEFT's format (PeftModel.from_pretrained(base, folder); `inflight export-merged`
                            writes the merged HF folder); the base stays model.path
        train_state.pt      optimizer + scheduler state, RNG states (torch.save; read back with weights_only=True);
                            FSDP2: the optimizer state gathered unsharded, keyed by parameter name
        state.json          step, weight version, samples trained, stream / prompt position (human-readable)
        critic/             algo.advantage=gae: the critic's trained tensors (critic.safetensors; with trainer.lora
                            its adapter and head) and its optimizer and scheduler (train_state.pt), trainer/critic.py

A checkpoint is written to a hidden temporary folder next to its final place and renamed into place, so a crash
while writing leaves either the previous checkpoint or the new one, never half of one; only folders holding a
state.json count. The last `keep` step checkpoints are kept (plus "final", written on a clean stop).

Positions. The actor gives group k the k-th prompt of the task's training order, so one number is both the
data-loader position and the stream position: `next_group`, the start index of the first group not yet trained.
Groups with a lower index were trained (or given up by the actor: `skipped_groups`, or dropped by dynamic
sampling: `dropped_groups`, a count); groups from `next_group` on
(in flight, buffered, or in the stream at the crash) were never trained and are generated again after a resume,
from the same prompts, with the resumed weights.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inflight.config import RunConfig
from inflight.trainer.lora import has_adapter

STATE_JSON = "state.json"
TRAIN_STATE = "train_state.pt"
CRITIC = "critic"


@dataclass
class CheckpointState:
    step: int  # optimizer steps taken
    version: int  # weight version (== step for the built-in backends)
    samples_trained: int
    next_group: int  # stream / prompt position: the first group index not trained
    skipped_groups: list[int] = field(default_factory=list)  # indices < next_group the actor gave up on
    dropped_groups: int = 0  # indices < next_group dropped by dynamic sampling (rewards all equal)
    server_version: int = 0  # version published to the actor (sync mode may lag the trainer)
    elapsed_s: float = 0.0  # training time before this checkpoint (max_minutes counts across resumes)
    groups_per_step: int = 0
    group_size: int = 0
    seed: int = 0
    time: float = field(default_factory=time.time)

    @property
    def groups_trained(self) -> int:
        return self.next_group - len(self.skipped_groups) - self.dropped_groups


def rng_state() -> dict[str, Any]:
    """Every RNG the trainer may draw from, as plain types and tensors (loadable with weights_only=True)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    legacy = np.random.get_state()  # the legacy tuple form: (kind, keys, pos, has_gauss, gauss)
    assert isinstance(legacy, tuple)
    kind, keys, pos, has_gauss, gauss = legacy
    state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def is_complete(path: Path) -> bool:
    """A folder a save finished: it holds state.json and is not a hidden .tmp-* / .old-* folder of a save in
    progress (a crash there can leave an empty state.json)."""
    return not path.name.startswith(".") and (path / STATE_JSON).is_file()


def save_checkpoint(root: str | Path, name: str, policy: Any, state: CheckpointState, keep: int = 2,
                    critic: Any = None) -> Path:
    """Write checkpoint `root/name` atomically (with the critic when there is one) and prune old step checkpoints;
    returns its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    try:
        policy.save(str(tmp))
        extra: dict[str, Any] = {"rng": rng_state()}
        if hasattr(policy, "train_state"):  # optimizer + scheduler (FSDP2: collective, the other ranks call it too)
            extra.update(policy.train_state())
        torch.save(extra, tmp / TRAIN_STATE)
        if critic is not None:
            critic.save(tmp / CRITIC)
        (tmp / STATE_JSON).write_text(json.dumps(asdict(state), indent=1))
        old = None
        if final.exists():  # "final" of an earlier run, or the same step written twice
            old = root / f".old-{name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune(root, keep)
    return final


def prune(root: Path, keep: int) -> None:
    # by recorded step, not name: past step 999999 the names outgrow their zero padding and sort wrongly
    by_step = sorted((read_state(p).step, p) for p in root.glob("step_*") if p.is_dir() and is_complete(p))
    steps = [p for _, p in by_step]
    for p in steps[: max(0, len(steps) - max(1, keep))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-*"):  # left by a crash while writing
        shutil.rmtree(p, ignore_errors=True)


def read_state(path: str | Path) -> CheckpointState:
    data = json.loads((Path(path) / STATE_JSON).read_text())
    return CheckpointState(**data)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of `run_dir` with the highest step (a "final" one counts with its step)."""
    root = Path(run_dir) / "checkpoints"
    found = [(read_state(p).step, p.name != "final", p) for p in root.glob("*") if p.is_dir() and is_complete(p)]
    return max(found)[2] if found else None


def model_folder(cfg: RunConfig, resume_from: str | Path | None) -> str:
    """The HF folder the trainer and the servers load: the checkpoint's on a resume, but with trainer.lora the
    base (model.path) always: a LoRA checkpoint holds the adapter only, which the trainer loads on top and pushes
    to the servers before the actor starts."""
    if resume_from is None or cfg.trainer.lora is not None:
        return str(cfg.model.path)
    return str(resume_from)


def restore_trainer(policy: Any, path: str | Path) -> CheckpointState:
    """Optimizer, scheduler, RNG states and version of checkpoint `path` into a policy whose weights were loaded
    from `path` (make_trainer(path, ...).init()), or, with trainer.lora, from the base and its adapter read here
    (make_trainer(model.path, ...).init()). Returns the checkpoint's state."""
    state = read_state(path)
    lora = getattr(policy, "adapter", None) is not None
    if has_adapter(path) != lora:
        raise ValueError(f"checkpoint {path} holds {'a LoRA adapter' if has_adapter(path) else 'full weights'}: "
                         f"resume it with{'' if has_adapter(path) else 'out'} trainer.lora, as the run was trained")
    if lora:
        policy.load_adapter(str(path))
    # FSDP2 reads rank 0's optimizer state only: mapped, not read, the other ranks never bring those tensors in
    mmap = bool(getattr(policy, "train_state_from_rank0", False))
    extra = torch.load(Path(path) / TRAIN_STATE, map_location="cpu", weights_only=True, mmap=mmap)
    if hasattr(policy, "load_train_state"):
        if "optimizer" not in extra:  # FSDP2 checkpoints written before the optimizer state was saved
            raise ValueError(f"checkpoint {path} holds no optimizer state: it cannot be resumed exactly")
        policy.load_train_state(extra)
    set_rng_state(extra["rng"])
    policy.version = state.version
    return state


def restore_critic(critic: Any, path: str | Path) -> None:
    """The critic of checkpoint `path` (weights, optimizer, scheduler) into a critic built as the run built it."""
    folder = Path(path) / CRITIC
    if not folder.is_dir():
        raise ValueError(f"checkpoint {path} holds no critic: it was trained without algo.advantage=gae")
    critic.load(folder)


def check_compatible(state: CheckpointState, cfg: RunConfig) -> None:
    """A resume must keep what the positions mean: groups per step, group size and the prompt order (seed)."""
    a = cfg.actor
    diffs = [f"{k}: checkpoint {old} != config {new}" for k, old, new in (
        ("actor.groups_per_step", state.groups_per_step, a.groups_per_step),
        ("actor.group_size", state.group_size, a.group_size), ("seed", state.seed, cfg.seed)) if old != new]
    if diffs:
        raise ValueError("cannot resume with a different " + "; ".join(diffs))
