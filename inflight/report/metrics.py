"""Run metrics: one JSON line per event from every role into runs/<name>/metrics.jsonl, plus TensorBoard.

Every role process opens its own `MetricsLogger`; lines are appended with one O_APPEND write each, so concurrent
writers from several processes never interleave inside a line.

    log = MetricsLogger(run_dir, "trainer")
    log.log("train_step", step=3, loss=0.12, lag_max=1)
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN/inf become None, numpy/torch scalars become Python numbers."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsLogger:
    def __init__(self, run_dir: str | Path, role: str, tensorboard: bool = False, wandb: bool = False,
                 config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.role = role
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.run_dir / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: start-up cost (tensorboard), only when on

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard" / role))  # a folder per role
        self._wandb = None
        if wandb:
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb as wb  # lazy: optional dependency (pipeline.wandb)

            self._wandb = wb.init(project="inflight", name=f"{self.run_dir.name}-{role}", dir=str(self.run_dir),
                                  config=config or {}, reinit=True)
        self._counts: dict[str, int] = {}

    def log(self, event: str, step: int | None = None, **values: Any) -> dict:
        record = {"time": time.time(), "role": self.role, "event": event}
        if step is not None:
            record["step"] = int(step)
        record.update(_clean(values))
        os.write(self._fd, (json.dumps(record) + "\n").encode())
        x = step if step is not None else self._counts.get(event, 0)
        self._counts[event] = self._counts.get(event, 0) + 1
        numeric = {k: v for k, v in record.items() if k not in ("time", "step")
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(f"{event}/{k}", v, x)
        if self._wandb is not None and numeric:
            self._wandb.log({f"{self.role}/{event}/{k}": v for k, v in numeric.items()})
        return record

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_metrics(run_dir: str | Path, event: str | None = None, role: str | None = None) -> list[dict]:
    """All records of a run (optionally one event / one role), in file order; a torn last line is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (event is None or rec.get("event") == event) and (role is None or rec.get("role") == role):
            out.append(rec)
    return out


class MetricsTail:
    """Incremental reader of metrics.jsonl for the launcher's live progress (only complete lines)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS_FILE
        self._pos = 0
        self._buf = b""

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._pos)
            data = f.read()
        self._pos += len(data)
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out
