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
