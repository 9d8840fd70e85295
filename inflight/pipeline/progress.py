"""Live progress line in the terminal (tqdm): step, samples/s, reward, held-out accuracy, lag, completions cut off by
the length limit (trunc), paused share.
It reads what the roles append to metrics.jsonl, so it shows exactly what the run records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from inflight.config import RunConfig
from inflight.report.metrics import MetricsTail


class Progress:
    def __init__(self, cfg: RunConfig, enabled: bool = True):
        self.enabled = enabled
        self.tail = MetricsTail(Path(cfg.pipeline.run_dir) / cfg.name)
        self.bar = None
        self.total = cfg.pipeline.max_steps or None
        self.state: dict[str, Any] = {}

    def _bar(self):
        if self.bar is None and self.enabled:
            self.bar = tqdm(total=self.total, desc="train", unit="step", mininterval=1.0, dynamic_ncols=True)
        return self.bar

    def servers(self, records: list[dict]) -> None:
        shares = [r["paused_share"] for r in records if r.get("paused_share") is not None]
        if shares:
            self.state["paused"] = f"{100 * sum(shares) / len(shares):.0f}%"

    def update(self, run_dir: Any = None) -> None:
        step = None
        for r in self.tail.read_new():
            ev = r.get("event")
            if ev == "train_step":
                step = r.get("step")
                el = max(r.get("elapsed_s") or 1e-9, 1e-9)
                self.state.update(reward=f"{r.get('reward_mean', 0):.2f}", lag=f"{r.get('lag_max', 0):.0f}",
                                  sps=f"{r.get('samples_total', 0) / el:.0f}")
                if r.get("truncated_frac") is not None:
                    self.state["trunc"] = f"{100 * r['truncated_frac']:.0f}%"
            elif ev == "eval" and r.get("accuracy") is not None:
                if r.get("base"):  # the starting weights, measured before any rollout
                    self.state["base"] = f"{100 * r['accuracy']:.1f}%"
                    if self.enabled:
                        tqdm.write(f"base model held-out accuracy: {100 * r['accuracy']:.1f}% "
                                   f"({r.get('num_problems')} problems, before RL)")
                self.state["acc"] = f"{100 * r['accuracy']:.1f}%"
        bar = self._bar()
        if bar is None:
            return
        if step is not None:
            bar.n = step
        bar.set_postfix(self.state, refresh=step is not None)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
