"""README's "From Python" example runs as written: its block is taken from README.md and executed as a script, with
`run_pipeline` wrapped to put the same config on a tiny random model for two steps in a temporary folder (free
ports, small evaluations). Everything else, the config it builds and the result it reads back, is the README's."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from tests.reliability.pipeline_helpers import free_base_port, free_port

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block() -> str:
    """The README's one ```python block that calls run_pipeline."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "run_pipeline(" in b]
    assert len(blocks) == 1, "README.md should hold one ```python block with run_pipeline"
    return blocks[0]


def test_readme_block_is_short_and_complete():
    code = python_block()
    assert 12 <= len(code.strip().splitlines()) <= 30
    compile(code, "README.md", "exec")  # a syntax error shows without a pipeline run


@pytest.mark.slow  # one pipeline run (servers, actor and trainer as processes): ~50 s
def test_readme_python_example_runs(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import inflight.pipeline.launcher as launcher

    real = launcher.run_pipeline
    seen = {}

    def tiny(cfg, resume=False):
        seen["readme"] = copy.deepcopy(cfg)  # what the README built, before the test's changes
        cfg.model.path = str(tiny_model_dir)
        cfg.pipeline.run_dir = str(tmp_path / "runs")
        cfg.pipeline.max_steps, cfg.pipeline.progress, cfg.pipeline.weight_sync_port = 2, False, free_port()
        cfg.server.base_port = free_base_port(1)
        cfg.task.eval_size = 8
        cfg.actor.group_size, cfg.actor.groups_per_step, cfg.actor.eval_every = 2, 2, 1
        return real(cfg, resume=resume)

    monkeypatch.setattr(launcher, "run_pipeline", tiny)
    monkeypatch.chdir(tmp_path)
    exec(compile(python_block(), "README.md", "exec"), {"__name__": "__main__"})

    cfg = seen["readme"]
    assert cfg.name == "arith-grpo" and cfg.task.name == "arith" and cfg.algo.loss == "grpo"
    run = tmp_path / "runs" / "arith-grpo"
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and f"report: {run / 'report.html'}" in out
    assert (run / "report.html").exists() and (run / "checkpoints" / "final" / "config.json").exists()
