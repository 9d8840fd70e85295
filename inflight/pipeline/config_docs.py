"""docs/configuration.md, generated from the config dataclasses so it stays true:

    python -m inflight.pipeline.config_docs            # rewrite docs/configuration.md
    python -m inflight.pipeline.config_docs --check    # exit 1 if it is out of date

Each option's description is its field's `help` (config/engine.py's settings), else the comment on its line in the
dataclass source.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any

from inflight.config import RunConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

HEADER = """# Configuration

Every run is one `RunConfig`: the defaults below, then a YAML file, then `key.sub=value` overrides on the command
line (`inflight train configs/cpu-demo.yaml trainer.lr=1e-4 pipeline.mode=sync`). Unknown keys and wrong types fail
with a message naming the key. Each run saves its resolved config as `runs/<name>/config.yaml`.

This file is generated from the dataclasses (`python -m inflight.pipeline.config_docs`); a test keeps it up to date.
"""


def _comments(cls: type) -> dict[str, str]:
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out = {}
    for line in src.splitlines():
        m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value}`"


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else (f.type.__name__ if isinstance(f.type, type) else str(f.type))
    return t.replace("|", "\\|")


def _optional_section(f: dataclasses.Field) -> list[type]:
    """The dataclass of a `Section | None = None` option (its keys are documented under it)."""
    return [a for a in typing.get_args(f.type) if isinstance(a, type) and dataclasses.is_dataclass(a)]


ALGORITHMS = """
### Which algorithm when

| algorithm | settings | when to use it |
|---|---|---|
| GRPO with truncated IS (default) | `algo.loss=grpo` | the default: group-relative advantages, a token's π/μ capped at `is_cap`; robust to the lag of pipelined training |
| PPO-clip (no critic) | `algo.loss=ppo` | the usual clipped surrogate on π/μ; small lags only (a stale token's clip stops its gradient) |
| decoupled PPO (AReaL) | `algo.loss=decoupled_ppo` | large staleness: the clip around the weights before this step, π_prox/μ as a capped weight |
| AIPO (LlamaRL) | `algo.loss=aipo` | fully asynchronous runs: REINFORCE with a one-sided cap ρ on π/μ |
| GSPO (Zheng et al. 2025) | `algo.loss=gspo` | sequence rewards with long answers or MoE models: one ratio per sample (geometric mean of π/μ), clipped per sequence in [1−3e-4, 1+4e-4] |
| GSPO-token | `algo.loss=gspo_token` | GSPO with per-token advantages (e.g. REINFORCE++'s KL in the return); the same as GSPO when a sample's advantages are equal |
| CISPO (MiniMax-M1) | `algo.loss=cispo` | long reasoning where PPO's clip drops rare, decisive tokens: the IS weight is clipped and detached, every token keeps its gradient; token-mean loss |
| Dr. GRPO (Liu et al. 2025) | `algo.normalization=constant` (`normalize_std=false`, the default) | unbiased GRPO: no std division, no per-answer length normalisation (a constant, `actor.max_new_tokens` unless `norm_constant`); answers do not grow to dilute a penalty |
| REINFORCE++ (Hu 2025) | `algo.advantage=reinforce_pp` (`kl_reward_coef` for the KL in the return) | one answer per prompt, or reward models prone to hacking: advantages normalised over the whole step's tokens |
| REINFORCE++-baseline | `algo.advantage=reinforce_pp_baseline` | several answers per prompt (reasoning): the group's mean reward subtracted first, then the step normalisation |
| PPO with a critic (GAE) | `algo.advantage=gae algo.loss=ppo` (`critic.*`; `algo.gamma`, `algo.lam`: 1, 1 as in verl) | one answer per prompt, or per-token credit from a learned value instead of a group baseline: costs a second model (memory and a forward/backward per step); `critic.warmup_steps` trains the critic alone first; on fsdp2 the critic is sharded like the policy (with `trainer.lora` too: its own adapter and the value head) |
| masked IS (MIS) | `algo.is_mask=sequence` or `geometric` (any loss) | the generator and trainer disagree (another engine, bf16 vs fp32): samples whose π/μ leaves [`is_mask_low`, `is_mask_high`] are left out |
| dynamic sampling (DAPO) | `actor.dynamic_sampling=true` (any loss) | many groups solved or failed alike (an easy or hard task): those groups are dropped and replaced, so every step trains `groups_per_step` groups with a signal, at the cost of extra generation |
"""


def render() -> str:
    lines = [HEADER]
    top = [f for f in dataclasses.fields(RunConfig) if not dataclasses.is_dataclass(_default(f))]
    comments = _comments(RunConfig)
    lines += ["## top level", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{f.name}` | {_type(f)} | {_fmt(_default(f))} | {comments.get(f.name, '')} |" for f in top]
    for f in dataclasses.fields(RunConfig):
        sub = _default(f)
        if not dataclasses.is_dataclass(sub) or isinstance(sub, type):
            continue
        cls = type(sub)
        comments = _comments(cls)
        lines += ["", f"## `{f.name}` ({cls.__module__}.{cls.__name__})", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for g in dataclasses.fields(cls):
            meaning = g.metadata.get("help") or comments.get(g.name, "")  # config/engine.py's settings carry it
            if g.metadata.get("choices"):
                meaning = f"{' / '.join(g.metadata['choices'])}: {meaning}"
            lines.append(f"| `{f.name}.{g.name}` | {_type(g)} | {_fmt(_default(g))} | {meaning.replace('|', '/')} |")
            for opt in _optional_section(g):  # e.g. trainer.lora: null, or these keys once one is set
                sub_comments = _comments(opt)
                for h in dataclasses.fields(opt):
                    lines.append(f"| `{f.name}.{g.name}.{h.name}` | {_type(h)} | {_fmt(_default(h))} | "
                                 f"{sub_comments.get(h.name, '').replace('|', '/')} |")
        if f.name == "algo":
            lines.append(ALGORITHMS.rstrip("\n"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not DOC_PATH.exists() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is out of date: run python -m inflight.pipeline.config_docs", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
