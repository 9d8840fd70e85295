"""The role processes of the Ray launcher: plain classes that `ray_launcher.py` turns into Ray actors.

`ServerActor` runs the built-in inference server inside the actor's own worker process (uvicorn on a thread), bound
to the node IP that Ray reports, so the server dies exactly when its actor does. When Ray restarts the actor
(`max_restarts`), the new server sits behind the weight gate of pipeline/restart.py: it answers 503 until the
trainer's next weight update gave it the current weights. `RoleActor` runs one of the local launcher's role entry
points (trainer rank, actor) unchanged. Both write their output to runs/<name>/logs/<role>.log like the local
launcher's children. Nothing here imports Ray at module level: the local launcher never needs it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
import warnings

import uvicorn

from inflight.config.engine import ServerConfig
from inflight.engine import serve
from inflight.engine.api.http_server import uvicorn_config
from inflight.pipeline import roles
from inflight.pipeline.launch_common import server_argv
from inflight.pipeline.restart import WeightGate
from inflight.report.metrics import MetricsLogger


def _log_to(log_path: str) -> None:
    """Send this worker process's stdout/stderr to the role's log file (the worker hosts this role only)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def node_ip() -> str:
    import ray  # lazy: optional dependency (the Ray launcher's only)

    return ray.util.get_node_ip_address()


def node_id() -> str:
    import ray  # lazy: optional dependency (the Ray launcher's only)

    return ray.get_runtime_context().get_node_id()


class ServerActor:
    """Inference server k on whichever node Ray placed it; `url()` is its address as other hosts reach it.
    `model`: the weights it loads; `cuda`: whether Ray gave it a GPU."""

    def __init__(self, server: ServerConfig, k: int, run_dir: str, model: str, cuda: bool):
        import ray  # lazy: optional dependency (the Ray launcher's only)

        _log_to(os.path.join(run_dir, "logs", f"server{k}.log"))
        ip = node_ip()
        argv = server_argv(server, k, model, cuda)[4:]  # drop `python -m inflight.cli serve`
        argv[argv.index("--host") + 1] = ip
        argv += ["--allow-remote-admin"]  # the trainer is on another host; the API key guards the admin endpoints
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        args = parser.parse_args(argv)
        with warnings.catch_warnings():  # deprecated in Ray 2.x without a replacement for this question
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        app = serve.build_app(args)
        if restarted:
            app = WeightGate(app)
            log = MetricsLogger(run_dir, f"server{k}")
            log.log("server_restart", server=k, node_ip=ip, pid=os.getpid())
            log.close()
            print(f"server{k}: restarted by Ray on {ip}; waiting for the current weights", flush=True)
        config = uvicorn_config(app, host=ip, port=args.port, log_level=args.log_level,
                                header_timeout_s=args.header_timeout_s)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"server{k}", daemon=True)
        self._thread.start()
        deadline = time.time() + 60
        while not self._server.started:  # raise here (the actor fails) rather than serve nothing
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"server{k}: uvicorn did not start on {ip}:{args.port} (port taken?)")
            time.sleep(0.05)
        self._url = f"http://{ip}:{args.port}"

    def url(self) -> str:
        return self._url

    def node_id(self) -> str:
        return node_id()

    def pid(self) -> int:
        return os.getpid()


class RoleActor:
    """One role of pipeline/roles.py (`trainer_main`, `actor_main`) in a Ray worker process."""

    def __init__(self, name: str, run_dir: str):
        self.name = name
        _log_to(os.path.join(run_dir, "logs", f"{name}.log"))

    def node_ip(self) -> str:
        return node_ip()

    def node_id(self) -> str:
        return node_id()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, entry: str, args: tuple, env: dict[str, str]) -> int:
        os.environ.update(env)
        if entry not in ("trainer_main", "actor_main"):
            raise ValueError(f"unknown role entry {entry!r}")
        getattr(roles, entry)(*args)
        sys.stdout.flush()
        return 0
