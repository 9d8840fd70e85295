"""The part of a run every launcher shares: start the roles, watch them until the trainer is done, end the run.

    code = supervise(cfg, run_dir, log, progress, start, stop)

`start()` starts every role (processes, Ray actors, ...) and returns the servers' URLs and `trainer_done()`, which
answers True once the trainer finished and raises RoleFailed when a role died. Meanwhile the servers' /metrics are
scraped and the progress line is updated; at the end the final weights are evaluated and `run_done` is recorded.
`stop()` always runs and takes every role down. A failed role or Ctrl-C ends the run with a message and a record.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any, Callable

from inflight.actor.evaluate import evaluate
from inflight.actor.run import env_rollout, served_names
from inflight.actor.server_pool import ServerPool
from inflight.config import RunConfig
from inflight.pipeline.scrape import ServerScraper
from inflight.report.metrics import MetricsLogger, read_metrics
from inflight.report.page import write_report
from inflight.tasks import get_task


class RoleFailed(RuntimeError):
    def __init__(self, role: str, message: str):
        super().__init__(message)
        self.role = role


def supervise(cfg: RunConfig, run_dir: Path, log: MetricsLogger, progress: Any,
              start: Callable[[], tuple[list[str], Callable[[], bool]]], stop: Callable[[], None]) -> int:
    """Returns 0 when the trainer finished (the report is written), 1 when a role failed, 130 on Ctrl-C."""
    code = 0
    try:
        urls, trainer_done = start()
        scraper = ServerScraper(urls, log, cfg.server.api_key)
        next_scrape = 0.0
        while not trainer_done():
            if time.time() >= next_scrape:
                next_scrape = time.time() + cfg.pipeline.scrape_every_s
                progress.servers(scraper.scrape())
            progress.update(run_dir)
            time.sleep(0.2)
        progress.servers(scraper.scrape())
        final_eval(cfg, run_dir, urls, log)
        progress.update(run_dir)
        log.log("run_done", elapsed_s=time.time() - log_start(run_dir))
    except RoleFailed as exc:
        progress.close()
        print(f"\ninflight: {exc}", file=sys.stderr)
        log.log("role_failed", failed_role=exc.role, message=str(exc)[:2000])
        code = 1
    except KeyboardInterrupt:
        progress.close()
        print("\ninflight: interrupted; stopping every role", file=sys.stderr)
        log.log("interrupted")
        code = 130
    finally:
        progress.close()
        try:
            stop()
        finally:
            log.close()
    if code == 0:
        print(f"inflight: run finished; report: {write_report([run_dir])}")
    return code


def final_eval(cfg: RunConfig, run_dir: Path, urls: list[str], log: MetricsLogger) -> None:
    """Held-out accuracy of the final weights (the servers hold them now), so every run ends with a measurement."""
    if cfg.actor.eval_every <= 0:
        return
    version = max((r.get("step", 0) for r in read_metrics(run_dir, event="train_step")), default=0)

    async def main() -> dict:
        pool = ServerPool(urls, api_key=cfg.server.api_key or None, adapter=cfg.actor.adapter,
                          request_timeout_s=cfg.actor.request_timeout_s)
        try:
            task = get_task(cfg.task)
            episode = None
            if hasattr(task, "make_env"):  # a multi-turn task: whole episodes, scored by the environment
                rollout: Any = env_rollout(cfg, task)  # episode_rollout (actor/episode.py) attaches `.episode`
                episode = rollout.episode
            # a LoRA run on stock vLLM: the final version's adapter, by name (actor/run.py)
            return await evaluate(task, pool, cfg.actor, episode=episode, served=served_names(cfg), version=version)
        finally:
            await pool.aclose()

    try:
        res = asyncio.run(main())
    except Exception as exc:  # the run itself succeeded; say why the last measurement is missing
        print(f"inflight: final evaluation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    log.log("eval", step=version, accuracy=res.get("pass@1"), final=True, trainer_version=version,
            **{k: v for k, v in res.items() if k != "labels"})


def log_start(run_dir: Path) -> float:
    starts = read_metrics(run_dir, event="run_start")
    return starts[-1]["time"] if starts else time.time()
