"""The Ray cluster a `pipeline.launcher=ray` run uses: joining one or starting its own, the auth mode of the one it
starts, and placement that fails with a message instead of waiting forever.

Auth (Ray >= 2.5x token authentication, `ray/_private/authentication/authentication_token_setup.py`): a new local
cluster started by `ray.init()` turns token auth on and writes `~/.ray/auth_token` when RAY_AUTH_MODE is unset; a
later `ray start --head` turns token auth on whenever that file exists, while `ray start --address` and
`ray.init(address=HOST:PORT)` do not, so their handshake fails with "InvalidAuthToken". inflight decides explicitly:
the cluster it starts itself uses token auth with a fresh per-run token held in the environment (RAY_AUTH_TOKEN, read
before any token file; nothing is written to ~/.ray). A cluster it joins keeps the user's RAY_AUTH_MODE /
RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH (docs/multi-host.md).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from typing import Any

from inflight.config import RunConfig
from inflight.pipeline.supervise import RoleFailed


def role_cpus(cfg: RunConfig) -> dict[str, float]:
    """Logical CPUs each role asks Ray for (Ray's bookkeeping, not cores): servers max(1, server.threads), each
    trainer rank max(1, trainer.threads), the actor 1."""
    ranks = cfg.trainer.num_processes if cfg.trainer.backend == "fsdp2" else 1
    out = {f"server{k}": float(max(1, cfg.server.threads)) for k in range(cfg.server.num_servers)}
    out.update({("trainer" if r == 0 else f"trainer-rank{r}"): float(max(1, cfg.trainer.threads))
                for r in range(ranks)})
    out["actor"] = 1.0
    return out


def local_cluster_cpus(cfg: RunConfig) -> int:
    """Logical CPUs of the single-node cluster the run starts: all its roles fit at once (the actor is I/O-bound
    and the roles' threads are set by their own settings, so this over-commits no core), at least os.cpu_count()."""
    return max(int(sum(role_cpus(cfg).values()) + 0.999), os.cpu_count() or 1)


def connect(cfg: RunConfig) -> None:
    """Join the cluster at `pipeline.ray_address` ('auto' = the one started on this host with `ray start`;
    host:port), or with no address start a single-node cluster for this run, sized to fit its roles."""
    address = cfg.pipeline.ray_address
    if not address and "RAY_AUTH_MODE" not in os.environ:  # the new cluster's processes inherit these
        set_ray_auth({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})
    try:
        import ray  # lazy: optional dependency (pipeline.launcher=ray)
    except ImportError:
        raise ValueError("pipeline.launcher=ray needs Ray: pip install 'inflight-rl[ray]'") from None
    if address:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        return
    ray.init(address="local", num_cpus=local_cluster_cpus(cfg), log_to_driver=False, logging_level=logging.WARNING,
             include_dashboard=False)


def set_ray_auth(values: dict[str, str | None]) -> None:
    """Set (None: remove) RAY_AUTH_* variables for this process and the Ray processes it starts. Ray reads the auth
    mode into its C++ config once, at import, and caches the token: when Ray is already imported, refresh both, as
    Ray's own `_enable_token_auth` does (Ray 2.60, ray/_private/authentication/authentication_token_setup.py)."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if "ray" in sys.modules:
        from ray import _raylet  # lazy: optional dependency (imported already here)

        _raylet.Config.initialize("")  # type: ignore[attr-defined]  # missing from ray's _raylet.pyi
        _raylet.AuthenticationTokenLoader.instance().reset_cache()  # type: ignore[attr-defined]  # as above


def placed(calls: dict[str, Any], timeout_s: float, asked: dict[str, dict[str, float]]) -> dict[str, Any]:
    """{role: ray.get(ref)} for the first call of each role's actor (it answers once the actor is placed and
    constructed), or RoleFailed after timeout_s naming the roles that did not answer, what each asked for and what
    the cluster has: Ray itself waits forever for resources it lacks."""
    import ray  # lazy: optional dependency (pipeline.launcher=ray)

    refs = list(calls.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    late = [role for role, ref in calls.items() if ref not in ready]
    if late:
        total, free = ray.cluster_resources(), ray.available_resources()
        never = [r for r in late if any(total.get(k, 0.0) < v for k, v in asked[r].items())]
        what = "; ".join(f"'{r}' asks for {_fmt(asked[r])}" for r in late)
        why = (f"the cluster can never hold {', '.join(repr(r) for r in never)}: Ray would wait forever"
               if never else "each fits the cluster, so a role is waiting for resources other roles hold, or still "
                             "starting (a server loading its model)")
        raise RoleFailed(late[0], f"Ray roles not up within {timeout_s:g} s (pipeline.startup_timeout_s): {what}. "
                                  f"The cluster has {_fmt(total)}, free now {_fmt(free)}; {why}. Give the cluster "
                                  "more (ray start --num-cpus / --num-gpus / --resources), ask for less "
                                  "(server.threads, trainer.threads, server_devices), fix pipeline.ray_resources, "
                                  "or raise pipeline.startup_timeout_s")
    return dict(zip(calls, ray.get(refs), strict=True))


def _fmt(res: dict[str, float]) -> str:
    keep = {k: v for k, v in sorted(res.items()) if k not in ("memory", "object_store_memory")
            and not k.startswith("node:__internal")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in keep.items()) + "}"
