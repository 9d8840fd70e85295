"""`run_pipeline(cfg)`: start the inference servers, the trainer and the actor as separate processes, watch them,
and stop everything when the trainer is done, on Ctrl-C, or when any role dies (naming it, with its last log
lines). Every role logs to runs/<name>/logs/<role>.log and appends events to runs/<name>/metrics.jsonl; the
launcher itself scrapes each server's /metrics and shows live progress.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from inflight.config import save_config
from inflight.pipeline import checkpoint as ckpt
from inflight.pipeline.metrics import MetricsLogger
from inflight.pipeline.procs import Child, ProcessGroup
from inflight.pipeline.progress import Progress
from inflight.pipeline.roles import actor_main, trainer_main
from inflight.pipeline.supervise import RoleFailed, supervise


def run_dir_of(cfg: Any) -> Path:
    return Path(cfg.pipeline.run_dir) / cfg.name


def check_config(cfg: Any) -> None:
    p = cfg.pipeline
    if p.mode not in ("pipelined", "sync"):
        raise ValueError(f"pipeline.mode must be 'pipelined' or 'sync', got {p.mode!r}")
    if p.update_mode not in ("keep", "interrupt"):
        raise ValueError(f"pipeline.update_mode must be 'keep' or 'interrupt', got {p.update_mode!r}")
    if p.mode == "sync" and p.num_grad_steps < 1:
        raise ValueError("pipeline.num_grad_steps must be >= 1")
    if not (p.max_steps or p.max_samples or p.max_minutes):
        raise ValueError("set at least one of pipeline.max_steps, max_samples, max_minutes")
    if p.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError("pipeline.wandb=true needs the wandb package: pip install wandb") from None
    if p.restart_servers and (cfg.server.engine != "builtin" or p.server_urls):
        raise ValueError("pipeline.restart_servers needs launcher-started built-in servers (server.engine=builtin)")
    if not Path(cfg.model.path).exists():
        raise ValueError(f"model.path '{cfg.model.path}' does not exist (build one with `inflight make-model`)")
    from inflight.modelkit.check import check_model_dir

    check_model_dir(cfg.model.path, need_chat_template=True)  # every task sends chat messages


def actor_config_for(cfg: Any) -> Any:
    """Sync mode is the staleness bound at num_grad_steps - 1 with weights published once per round: the actor
    then generates exactly one round of groups per published version (see docs/architecture.md)."""
    if cfg.pipeline.mode == "sync":
        cfg.actor.max_lag = cfg.pipeline.num_grad_steps - 1
    return cfg


def server_urls(cfg: Any) -> list[str]:
    if cfg.pipeline.server_urls:
        return list(cfg.pipeline.server_urls)
    s = cfg.server
    return [f"http://{s.host}:{s.base_port + k}" for k in range(s.num_servers)]


MAX_RESTARTS = 5  # per server and run: a server that keeps dying is a failure, not a fault to ride out


def server_command(cfg: Any, k: int, model: str | None = None, restart: bool = False) -> list[str]:
    """`inflight serve` for server k; `restart`: the same server behind the weight gate (pipeline/restart.py)."""
    s = cfg.server
    entry = ["-m", "inflight.pipeline.restart"] if restart else ["-m", "inflight.cli", "serve"]
    argv = [sys.executable, *entry, "--model", str(model or cfg.model.path), "--host", s.host,
            "--port", str(s.base_port + k), "--dtype", s.dtype, "--max-batch", str(s.max_batch),
            "--max-model-len", str(s.max_model_len), "--max-tokens-per-step", str(s.max_tokens_per_step),
            "--threads", str(s.threads), *(["--generator-precision", s.generator_precision] if s.generator_precision
                                              != "float32" else [])]
    if k < len(cfg.pipeline.server_devices):
        argv += ["--device", "cuda"]
    if s.engine != "builtin" and not restart:
        argv += ["--engine", s.engine]
    if s.api_key:
        argv += ["--api-key", s.api_key]
    return argv


def _thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads > 0 else {}


def start_trainer(procs: ProcessGroup, cfg: Any, run_dir: Path, urls: list[str], stream: Any,
                  env: dict[str, str], resume_from: Path | None = None) -> Child:
    """One trainer process, or trainer.num_processes FSDP2 ranks (rank 0 is 'trainer'); returns rank 0."""
    args = (cfg, str(run_dir), urls, stream, str(resume_from) if resume_from else None)
    if cfg.trainer.backend != "fsdp2":
        return procs.start_function("trainer", trainer_main, args, env=env)
    import socket

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


def wait_healthy(urls: list[str], children: list[Child], timeout_s: float, api_key: str = "") -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.time() + timeout_s
    pending = set(urls)
    with httpx.Client(timeout=2.0, headers=headers) as http:
        while pending:
            for child in children:
                if child.poll() is not None:
                    raise RoleFailed(child.name, f"{child.name} exited with code {child.poll()} while starting")
            for url in list(pending):
                try:
                    if http.get(url + "/health").status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
            if time.time() > deadline:
                raise RoleFailed("server", f"servers not healthy after {timeout_s:.0f} s: {sorted(pending)}")
            time.sleep(0.2)


def _failure_message(child: Child, tail_lines: int) -> str:
    code = child.poll()
    why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return (f"role '{child.name}' stopped unexpectedly ({why}); last lines of {child.log_path}:\n"
            + "".join(f"  | {line}\n" for line in child.tail(tail_lines).splitlines()))


def open_run(cfg: Any, resume: bool) -> tuple[Any, Path, Path | None, ckpt.CheckpointState | None]:
    """What every launcher does first: check the config, find (resume) or start afresh the run folder, and save the
    resolved config there. Returns (cfg, run_dir, checkpoint folder or None, its state or None)."""
    check_config(cfg)
    cfg = actor_config_for(cfg)
    run_dir = run_dir_of(cfg)
    resume_from, state = prepare_resume(cfg, run_dir) if resume else (None, None)
    if not resume:
        fresh_run_dir(run_dir)
    save_config(cfg, run_dir)
    return cfg, run_dir, resume_from, state


def prepare_resume(cfg: Any, run_dir: Path) -> tuple[Path, ckpt.CheckpointState]:
    """The newest complete checkpoint of run_dir, checked against cfg; trainer records after it are moved to
    metrics.rolled_back.jsonl (the resumed run trains those steps again, so the record stays one line per step; it
    pushes the checkpoint's version again, so that push's record goes too)."""
    import json
    import os

    path = ckpt.latest_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    state = ckpt.read_state(path)
    ckpt.check_compatible(state, cfg)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        keep, gone = [], []
        for line in metrics.read_text().splitlines(keepends=True):
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut by the crash
            step = r.get("step") or 0
            # the checkpoint's own push may not have finished (it runs in the background): the resume pushes it again
            late = str(r.get("role", "")).startswith("trainer") and (
                step > state.step or (step == state.step and r.get("event") == "weight_push"))
            (gone if late else keep).append(line)
        if gone:
            with open(run_dir / "metrics.rolled_back.jsonl", "a") as f:
                f.writelines(gone)
        tmp = metrics.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, metrics)
    return path, state


def run_pipeline(cfg: Any, resume: bool = False) -> int:
    """Run the whole pipeline; returns 0 when the trainer finished, 1 when a role failed, 130 on Ctrl-C.
    `resume`: continue the run in cfg's run folder from its newest checkpoint (docs/reliability.md)."""
    from inflight.streams import make_stream

    if cfg.pipeline.launcher == "ray":
        from inflight.pipeline.ray_launcher import run_pipeline_ray

        return run_pipeline_ray(cfg, resume=resume)
    if cfg.pipeline.launcher != "local":
        raise ValueError(f"pipeline.launcher must be 'local' or 'ray', got {cfg.pipeline.launcher!r}")
    cfg, run_dir, resume_from, state = open_run(cfg, resume)
    log = MetricsLogger(run_dir, "launcher")
    log.log("run_start", mode=cfg.pipeline.mode, update_mode=cfg.pipeline.update_mode,
            resumed_from=str(resume_from) if resume_from else None,
            resumed_step=state.step if state else None)
    actor_resume = ({"next_group": state.next_group, "skipped": state.skipped_groups, "version": state.version}
                    if state else None)
    procs = ProcessGroup(run_dir / "logs")
    urls = server_urls(cfg)
    ctx = mp.get_context("spawn")
    stream = make_stream(cfg.pipeline, name=cfg.name, ctx=ctx,
                         capacity=2 * (cfg.actor.max_lag + 2) * cfg.actor.groups_per_step)
    if hasattr(stream, "reset"):
        stream.reset()
    progress = Progress(cfg, enabled=cfg.pipeline.progress)
    old_term = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    def start() -> tuple[list[str], Any]:
        if not cfg.pipeline.server_urls:
            for k in range(cfg.server.num_servers):
                env = _thread_env(cfg.server.threads)
                if k < len(cfg.pipeline.server_devices):
                    env["CUDA_VISIBLE_DEVICES"] = cfg.pipeline.server_devices[k]
                procs.start_command(f"server{k}", server_command(cfg, k, resume_from), env=env)
        # the trainer loads while the servers do (it waits for /health itself); the actor starts once they answer
        tenv = _thread_env(cfg.trainer.threads)
        if cfg.pipeline.trainer_devices:
            tenv["CUDA_VISIBLE_DEVICES"] = cfg.pipeline.trainer_devices
        trainer = start_trainer(procs, cfg, run_dir, urls, stream, tenv, resume_from)
        wait_healthy(urls, procs.children, cfg.pipeline.startup_timeout_s, cfg.server.api_key)
        log.log("servers_ready", urls=urls)
        procs.start_function("actor", actor_main, (cfg, str(run_dir), urls, stream, actor_resume), env=_thread_env(1))
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


def restart_dead_servers(cfg: Any, procs: ProcessGroup, restarts: dict[str, int], log: MetricsLogger) -> None:
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
        env = _thread_env(cfg.server.threads)
        if k < len(cfg.pipeline.server_devices):
            env["CUDA_VISIBLE_DEVICES"] = cfg.pipeline.server_devices[k]
        procs.start_command(child.name, server_command(cfg, k, restart=True), env=env)


def fresh_run_dir(run_dir: Path) -> None:
    """A run starts from an empty record: old metrics, logs, event files and report of the same name go."""
    import shutil

    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "report.html", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("logs", "tensorboard", "plots"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
