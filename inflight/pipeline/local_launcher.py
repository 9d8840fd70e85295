"""The local launcher (`pipeline.launcher: local`): start the inference servers, the trainer and the actor as
separate processes on this host, watch them, and stop everything when the trainer is done, on Ctrl-C, or when any
role dies (naming it, with its last log lines). Every role logs to runs/<name>/logs/<role>.log and appends events
to runs/<name>/metrics.jsonl; the launcher itself scrapes each server's /metrics and shows live progress.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from inflight.config import RunConfig
from inflight.config.limits import staleness
from inflight.pipeline.launch_common import (
    MAX_RESTARTS,
    open_run,
    server_command,
    server_urls,
    thread_env,
    wait_healthy,
)
from inflight.pipeline.procs import Child, ProcessGroup
from inflight.pipeline.progress import Progress
from inflight.pipeline.roles import actor_main, trainer_main
from inflight.pipeline.supervise import RoleFailed, supervise
from inflight.report.metrics import MetricsLogger
from inflight.streams import make_stream
from inflight.trainer.loop import checkpoint as ckpt


def run_pipeline_local(cfg: RunConfig, resume: bool = False) -> int:
    """Run the whole pipeline; returns 0 when the trainer finished, 1 when a role failed, 130 on Ctrl-C.
    `resume`: continue the run in cfg's run folder from its newest checkpoint (docs/reliability.md)."""
    cfg, run_dir, resume_from, state = open_run(cfg, resume)
    log = MetricsLogger(run_dir, "launcher")
    log.log("run_start", mode=cfg.pipeline.mode, update_mode=cfg.pipeline.update_mode,
            resumed_from=str(resume_from) if resume_from else None,
            resumed_step=state.step if state else None)
    actor_resume = ({"next_group": state.next_group, "skipped": state.skipped_groups,
                     "dropped": state.dropped_groups, "version": state.version}
                    if state else None)
    procs = ProcessGroup(run_dir / "logs")
    urls = server_urls(cfg)
    ctx = mp.get_context("spawn")
    stream = make_stream(cfg.pipeline, name=cfg.name, ctx=ctx,
                         capacity=staleness(cfg).stream_capacity)
    if hasattr(stream, "reset"):
        stream.reset()
    progress = Progress(cfg, enabled=cfg.pipeline.progress)
    old_term = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    def start() -> tuple[list[str], Any]:
        if not cfg.pipeline.server_urls:
            for k in range(cfg.server.num_servers):
                env = thread_env(cfg.server.threads)
                if k < len(cfg.pipeline.server_devices):
                    env["CUDA_VISIBLE_DEVICES"] = cfg.pipeline.server_devices[k]
                model = ckpt.model_folder(cfg, resume_from)  # LoRA: the base; the adapter comes with the first push
                procs.start_command(f"server{k}", server_command(cfg, k, model), env=env)
        # the trainer loads while the servers do (it waits for /health itself); the actor starts once they answer
        tenv = thread_env(cfg.trainer.threads)
        if cfg.pipeline.trainer_devices:
            tenv["CUDA_VISIBLE_DEVICES"] = cfg.pipeline.trainer_devices
        trainer = start_trainer(procs, cfg, run_dir, urls, stream, tenv, resume_from)
        wait_healthy(urls, procs.children, cfg.pipeline.startup_timeout_s, cfg.server.api_key)
        log.log("servers_ready", urls=urls)
        procs.start_function("actor", actor_main, (cfg, str(run_dir), urls, stream, actor_resume), env=thread_env(1))
        log.log("roles_started", pids={c.name: c.pid for c in procs.children})
        restarts: dict[str, int] = {}

        def trainer_done() -> bool:
            if trainer.poll() == 0:
                return True
            if cfg.pipeline.restart_servers:
                restart_dead_servers(cfg, procs, restarts, log)
            failed = next((c for c in procs.children if c.poll() not in (None, 0) or (c.poll() == 0 and not
                           c.name.startswith(("actor", "trainer")))), None)  # the actor may finish first
            if failed is not None:
                raise RoleFailed(failed.name, _failure_message(failed, cfg.pipeline.log_tail_lines))
            return False

        return urls, trainer_done

    def stop() -> None:
        if hasattr(stream, "close"):
            stream.close()
        procs.stop_all()
        signal.signal(signal.SIGTERM, old_term)

    return supervise(cfg, run_dir, log, progress, start, stop)


def start_trainer(procs: ProcessGroup, cfg: RunConfig, run_dir: Path, urls: list[str], stream: Any,
                  env: dict[str, str], resume_from: Path | None = None) -> Child:
    """One trainer process, or trainer.num_processes FSDP2 ranks (rank 0 is 'trainer'); returns rank 0."""
    args = (cfg, str(run_dir), urls, stream, str(resume_from) if resume_from else None)
    if cfg.trainer.backend != "fsdp2":
        return procs.start_function("trainer", trainer_main, args, env=env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = cfg.trainer.num_processes
    ranks = []
    for r in range(n):
        renv = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}
        ranks.append(procs.start_function("trainer" if r == 0 else f"trainer-rank{r}", trainer_main, args, env=renv))
    return ranks[0]


def _failure_message(child: Child, tail_lines: int) -> str:
    code = child.poll()
    why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return (f"role '{child.name}' stopped unexpectedly ({why}); last lines of {child.log_path}:\n"
            + "".join(f"  | {line}\n" for line in child.tail(tail_lines).splitlines()))


def restart_dead_servers(cfg: RunConfig, procs: ProcessGroup, restarts: dict[str, int], log: MetricsLogger) -> None:
    """Start a dead server again behind the weight gate (it serves only once the trainer pushed it the current
    weights); after MAX_RESTARTS of one server its death fails the run as usual."""
    for child in list(procs.children):
        if not child.name.startswith("server") or child.poll() is None or restarts.get(child.name, 0) >= MAX_RESTARTS:
            continue
        k = int(child.name[len("server"):])
        restarts[child.name] = restarts.get(child.name, 0) + 1
        log.log("server_restart", server=k, exit_code=child.poll(), restarts=restarts[child.name])
        print(f"inflight: {child.name} exited ({child.poll()}); restarting it", file=sys.stderr)
        procs.children.remove(child)
        env = thread_env(cfg.server.threads)
        if k < len(cfg.pipeline.server_devices):
            env["CUDA_VISIBLE_DEVICES"] = cfg.pipeline.server_devices[k]
        procs.start_command(child.name, server_command(cfg, k, restart=True), env=env)
