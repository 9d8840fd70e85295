"""What both launchers (local processes: local_launcher.py; Ray actors: ray_launcher.py) share: opening the run
folder (config checks, resume, saved config), the servers' addresses and command lines, the wait for their /health,
and the restart limit. It imports neither launcher; `launcher.run_pipeline` picks one by `pipeline.launcher`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import httpx

from inflight import backends
from inflight.algo import gae
from inflight.config import RunConfig, save_config
from inflight.config.engine import ServerConfig
from inflight.config.limits import staleness
from inflight.modelkit.check import check_model_dir
from inflight.pipeline.procs import Child
from inflight.pipeline.supervise import RoleFailed
from inflight.pipeline.transport_check import check_weight_transport
from inflight.trainer.loop import checkpoint as ckpt
from inflight.trainer.weight_sync import check_protocol_config

log = logging.getLogger(__name__)


def run_dir_of(cfg: RunConfig) -> Path:
    return Path(cfg.pipeline.run_dir) / cfg.name


def check_config(cfg: RunConfig) -> None:
    p = cfg.pipeline
    if p.mode not in ("pipelined", "sync"):
        raise ValueError(f"pipeline.mode must be 'pipelined' or 'sync', got {p.mode!r}")
    if p.update_mode not in ("keep", "interrupt"):
        raise ValueError(f"pipeline.update_mode must be 'keep' or 'interrupt', got {p.update_mode!r}")
    if p.mode == "sync" and p.num_grad_steps < 1:
        raise ValueError("pipeline.num_grad_steps must be >= 1")
    if not (p.max_steps or p.max_samples or p.max_minutes):
        raise ValueError("set at least one of pipeline.max_steps, max_samples, max_minutes")
    gae.check(cfg.algo, cfg.critic)
    if p.wandb:
        try:
            import wandb  # lazy: optional dependency, only checked for here  # noqa: F401
        except ImportError:
            raise ValueError("pipeline.wandb=true needs the wandb package: pip install wandb") from None
    if cfg.server.engine not in backends.names():
        raise ValueError(f"server.engine must be {backends.names_text()}, got {cfg.server.engine!r}")
    if cfg.server.python and not p.server_urls and not shutil.which(cfg.server.python):
        raise ValueError(f"server.python '{cfg.server.python}' does not exist (the python of vLLM's environment)")
    if p.restart_servers and (not backends.get(cfg.server.engine).restartable or p.server_urls):
        raise ValueError("pipeline.restart_servers needs launcher-started built-in servers (server.engine=builtin)")
    check_weight_transport(cfg)
    check_lora_run(cfg)
    check_ranks(cfg)
    warn_oversubscribed(cfg)
    if not Path(cfg.model.path).exists():
        raise ValueError(f"model.path '{cfg.model.path}' does not exist (build one with `inflight make-model`)")
    check_model_dir(cfg.model.path, need_chat_template=True)  # every task sends chat messages


def check_ranks(cfg: RunConfig) -> None:
    """FSDP2 deals each step's groups round-robin to the ranks: an uneven share leaves some ranks idle every step."""
    t, gps = cfg.trainer, cfg.actor.groups_per_step
    if t.backend != "fsdp2":
        return
    if t.num_processes < 1:
        raise ValueError(f"trainer.num_processes must be >= 1, got {t.num_processes}")
    if gps % t.num_processes:
        raise ValueError(f"actor.groups_per_step ({gps}) must be a multiple of trainer.num_processes "
                         f"({t.num_processes}) with trainer.backend=fsdp2: every rank trains an equal share of each "
                         "step's groups")


QUEUE_WAIT_STEPS = 512  # a queued sequence waiting this many decode steps or more gets a warning


def warn_oversubscribed(cfg: RunConfig) -> None:
    """Sequences the actor keeps in flight beyond what the launched servers decode at once wait in the servers'
    queues, and actor.request_timeout_s counts that wait. Short completions queue cheaply (a queue keeps the batch
    full while replies are built); a sequence that waits for more than QUEUE_WAIT_STEPS decode steps (whole rounds
    of max_new_tokens) before it starts risks the timeout and its retries, and gets a warning."""
    if cfg.pipeline.server_urls:  # servers run elsewhere: their batch limits are not in this config
        return
    a, s = cfg.actor, cfg.server
    per_request = a.group_size if a.use_n else 1  # use_n: one request carries the group's group_size sequences
    requested = a.concurrency_per_server * per_request * s.num_servers
    allowed = staleness(cfg).groups_allowed(0) * a.group_size  # the staleness bound caps the groups started
    in_flight = min(requested, allowed)
    capacity = s.max_batch * s.num_servers
    wait_steps = (math.ceil(in_flight / capacity) - 1) * a.max_new_tokens  # rounds queued x a round's steps
    if wait_steps > QUEUE_WAIT_STEPS:
        log.warning("the actor keeps up to %d sequences in flight (actor.concurrency_per_server %d x %d sequences "
                    "per request x %d servers = %d, staleness bound %d) but the servers decode %d at once "
                    "(server.max_batch %d x %d servers): the rest queue for up to %d decode steps (rounds of "
                    "actor.max_new_tokens %d), and actor.request_timeout_s (%.0f s) counts the wait; lower "
                    "actor.concurrency_per_server to %d or raise server.max_batch", in_flight,
                    a.concurrency_per_server, per_request, s.num_servers, requested,
                    allowed, capacity, s.max_batch, s.num_servers, wait_steps,
                    a.max_new_tokens, a.request_timeout_s, max(1, s.max_batch // per_request))


def check_lora_run(cfg: RunConfig) -> None:
    """trainer.lora pushes adapters: inflight's protocol (docs/inference-contract.md, "Adapter updates") or stock
    vLLM's runtime LoRA loading (trainer.protocol=vllm, trainer/protocols/vllm_lora.py); not SGLang's. Each
    protocol's module says what it takes (`check_config`)."""
    if cfg.trainer.lora is None:
        return
    check_protocol_config(cfg)


def server_urls(cfg: RunConfig) -> list[str]:
    if cfg.pipeline.server_urls:
        return list(cfg.pipeline.server_urls)
    s = cfg.server
    return [f"http://{s.host}:{s.base_port + k}" for k in range(s.num_servers)]


MAX_RESTARTS = 5  # per server and run: a server that keeps dying is a failure, not a fault to ride out


def server_command(cfg: RunConfig, k: int, model: str | None = None, restart: bool = False) -> list[str]:
    """`inflight serve` for server k, started by `server.python`; `restart`: the same server behind the weight gate
    (pipeline/restart.py, built-in only). The built-in options map to each engine's own (`engine_options`);
    `server.extra_args` come last, so they override what the mapping set."""
    return server_argv(cfg.server, k, str(model or cfg.model.path), cuda=k < len(cfg.pipeline.server_devices),
                       restart=restart)


def server_argv(s: ServerConfig, k: int, model: str, cuda: bool, restart: bool = False) -> list[str]:
    """`server_command` from the server's own settings: `model` its weights, `cuda` whether it gets a GPU."""
    python = s.python or sys.executable
    entry = ["-m", "inflight.pipeline.restart"] if restart else ["-m", "inflight.cli", "serve"]
    argv = [python, *entry, "--model", model, "--host", s.host, "--port", str(s.base_port + k),
            *engine_options(s, cuda=cuda)]
    if s.api_key:
        argv += ["--api-key", s.api_key]
    return argv + [str(a) for a in s.extra_args]


def engine_options(s: ServerConfig, cuda: bool) -> list[str]:
    """`server.*` as the engine's own options: `--engine NAME` for a backend with a launcher of its own, then the
    backend's mapping (its registration's `options`, inflight/backends.py)."""
    backend = backends.get(s.engine)
    engine = ["--engine", backend.name] if backend.launcher is not None else []
    return [*engine, *backends.resolve(backend.options)(s, cuda)]


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads > 0 else {}


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


def open_run(cfg: RunConfig, resume: bool) -> tuple[RunConfig, Path, Path | None, ckpt.CheckpointState | None]:
    """What every launcher does first: check the config, find (resume) or start afresh the run folder, and save the
    resolved config there. Returns (cfg, run_dir, checkpoint folder or None, its state or None)."""
    check_config(cfg)
    cfg.pipeline.startup_timeout_s = backends.startup_timeout(cfg)  # resolved once: every role reads this value
    run_dir = run_dir_of(cfg)
    resume_from, state = prepare_resume(cfg, run_dir) if resume else (None, None)
    if not resume:
        fresh_run_dir(run_dir)
    save_config(cfg, run_dir)
    return cfg, run_dir, resume_from, state


def prepare_resume(cfg: RunConfig, run_dir: Path) -> tuple[Path, ckpt.CheckpointState]:
    """The newest complete checkpoint of run_dir, checked against cfg; trainer records after it are moved to
    metrics.rolled_back.jsonl (the resumed run trains those steps again, so the record stays one line per step; it
    pushes the checkpoint's version again, so that push's record goes too)."""
    path = ckpt.latest_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    state = ckpt.read_state(path)
    ckpt.check_compatible(state, cfg)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        keep: list[str] = []
        gone: list[str] = []
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


def fresh_run_dir(run_dir: Path) -> None:
    """A run starts from an empty record: old metrics, logs, event files and report of the same name go."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "report.html", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("logs", "tensorboard", "plots"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
