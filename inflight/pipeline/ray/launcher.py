"""`pipeline.launcher: ray`: the same roles as the local launcher, placed on the hosts of a Ray cluster.

    inference servers  one Ray actor each (CPU/GPU resources), restarted by Ray when they die (max_restarts);
                       bound to the node IP that Ray reports, admin endpoints guarded by the API key
    trainer            one Ray actor (max_restarts=0), or trainer.num_processes rank actors in one STRICT_PACK
                       placement group (FSDP2 rendezvous at rank 0's node IP, as Ray reports it)
    actor (rollouts)   one Ray actor, anywhere
    stream             RedisStream (pipeline.stream=redis): every host reaches pipeline.redis_url

`pipeline.ray_resources` pins a role to hosts: {role: resource}, where resource is a custom resource of
`ray start --resources` or Ray's per-node `node:<ip>`; roles are server0..K-1, trainer, actor. The driver (this
process, on any host of the cluster) watches the roles, scrapes the servers and writes the report, as the local
launcher does. See docs/multi-host.md.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

from inflight import backends
from inflight.config import RunConfig
from inflight.config.limits import staleness
from inflight.pipeline.launch_common import MAX_RESTARTS, open_run, wait_healthy
from inflight.pipeline.progress import Progress
from inflight.pipeline.ray.cluster import connect, placed, role_cpus
from inflight.pipeline.ray.roles import RoleActor, ServerActor
from inflight.pipeline.supervise import RoleFailed, supervise
from inflight.report.metrics import MetricsLogger
from inflight.streams import RedisStream, make_stream
from inflight.trainer.loop import checkpoint as ckpt

PIN_AMOUNT = 0.001  # of a pinning resource per role: any number of roles fit on the host that has it


def check_ray_config(cfg: RunConfig) -> str:
    """Ray-specific checks; returns the API key the servers require (server.api_key or env INFLIGHT_API_KEY)."""
    p = cfg.pipeline
    if p.stream != "redis":
        raise ValueError("pipeline.launcher=ray needs pipeline.stream=redis (the actor and the trainer may run on "
                         "different hosts; set pipeline.redis_url to a Redis every host reaches, docs/multi-host.md)")
    if p.server_urls:
        raise ValueError("pipeline.launcher=ray starts the servers itself: leave pipeline.server_urls empty")
    if not backends.get(cfg.server.engine).ray:
        ray_ones = [n for n in backends.names() if backends.get(n).ray]
        raise ValueError(f"pipeline.launcher=ray supports server.engine={' or '.join(ray_ones)} only")
    key = cfg.server.api_key or os.environ.get("INFLIGHT_API_KEY", "")
    if not key:
        raise ValueError("pipeline.launcher=ray needs an API key (servers listen on the network): set "
                         "server.api_key=KEY or the environment variable INFLIGHT_API_KEY")
    roles = {f"server{k}" for k in range(cfg.server.num_servers)} | {"trainer", "actor"}
    unknown = set(p.ray_resources) - roles
    if unknown:
        raise ValueError(f"pipeline.ray_resources names unknown roles {sorted(unknown)}; roles: {sorted(roles)}")
    return key


def _resources(cfg: RunConfig, role: str) -> dict[str, float]:
    res = cfg.pipeline.ray_resources.get(role)
    return {str(res): PIN_AMOUNT} if res else {}


def start_servers(cfg: RunConfig, run_dir: str, model: str) -> list[Any]:
    import ray  # lazy: optional dependency (pipeline.launcher=ray)

    out = []
    for k in range(cfg.server.num_servers):
        gpus = 1 if k < len(cfg.pipeline.server_devices) else 0  # same rule as the local launcher; Ray picks the GPU
        cls = ray.remote(ServerActor).options(
            name=f"{cfg.name}-server{k}", num_cpus=role_cpus(cfg)[f"server{k}"], num_gpus=gpus,
            resources=_resources(cfg, f"server{k}"), max_restarts=MAX_RESTARTS if cfg.pipeline.restart_servers else 0,
            max_concurrency=4)
        out.append(cls.remote(cfg.server, k, run_dir, model, gpus == 1))
    return out


def start_trainer(cfg: RunConfig, run_dir: str, urls: list[str], stream: Any, resume_from: str | None
                  ) -> tuple[list[Any], list[Any], list[str], Any]:
    """Trainer rank actors, their run() refs and Ray node ids (rank 0 first), and the placement group (None for
    one rank)."""
    import ray  # lazy: optional dependency (pipeline.launcher=ray)
    from ray.util.placement_group import placement_group  # lazy: as ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # lazy: as ray

    n = cfg.trainer.num_processes if cfg.trainer.backend == "fsdp2" else 1
    cpus, gpus = role_cpus(cfg)["trainer"], (1 if cfg.trainer.device.startswith("cuda") else 0)
    pg = None
    opts: list[dict[str, Any]] = [{} for _ in range(n)]
    if n > 1:
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **_resources(cfg, "trainer")}
        pg = placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name=f"{cfg.name}-trainer")
        placed({"trainer": pg.ready()}, cfg.pipeline.startup_timeout_s,
               {"trainer": {k: v * n for k, v in bundle.items()}})
        opts = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)}
                for r in range(n)]
    else:
        opts[0] = {"resources": _resources(cfg, "trainer")}
    names = ["trainer" if r == 0 else f"trainer-rank{r}" for r in range(n)]
    actors = [ray.remote(RoleActor).options(name=f"{cfg.name}-{names[r]}", num_cpus=cpus, num_gpus=gpus,
                                            max_restarts=0, **opts[r]).remote(names[r], run_dir) for r in range(n)]
    # the servers reach the trainer's weight-update store at the address Ray reports for rank 0's node; ray's types
    # lack an actor method's .remote (hence the ignores)
    asked = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **_resources(cfg, "trainer")}
    first_ip = actors[0].node_ip.remote()  # type: ignore[attr-defined]
    ip = placed({"trainer": first_ip}, cfg.pipeline.startup_timeout_s, {"trainer": asked})["trainer"]
    # before run(): an actor runs one call at a time
    node_ids = ray.get([a.node_id.remote() for a in actors])  # type: ignore[attr-defined]
    cfg.pipeline.weight_sync_host = ip
    env = {}
    if cfg.trainer.backend == "fsdp2":  # FSDP2 forms its process group from these at any world size, 1 included
        port = ray.get(actors[0].free_port.remote())  # type: ignore[attr-defined]
        env = {"MASTER_ADDR": ip, "MASTER_PORT": str(port), "WORLD_SIZE": str(n)}
    args = (cfg, run_dir, urls, stream, resume_from)
    rank_env = [{**env, **({"RANK": str(r), "LOCAL_RANK": "0"} if env else {})} for r in range(n)]
    refs = [a.run.remote("trainer_main", args, rank_env[r]) for r, a in enumerate(actors)]  # type: ignore[attr-defined]
    return actors, refs, node_ids, pg


def _role_error(name: str, exc: BaseException, run_dir: str, tail_lines: int) -> RoleFailed:
    path = os.path.join(run_dir, "logs", f"{name}.log")
    try:
        with open(path, errors="replace") as f:
            tail = "".join(deque(f, maxlen=tail_lines))
    except FileNotFoundError:
        tail = "(no log on this host)"
    first = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
    return RoleFailed(name, f"role '{name}' stopped unexpectedly ({type(exc).__name__}: {first[0][:500]}); "
                            f"last lines of {path}:\n" + "".join(f"  | {line}\n" for line in tail.splitlines()))


def run_pipeline_ray(cfg: RunConfig, resume: bool = False) -> int:
    """`run_pipeline` on a Ray cluster: 0 when the trainer finished, 1 when a role failed, 130 on Ctrl-C."""
    api_key = check_ray_config(cfg)
    cfg, run_dir, resume_from, state = open_run(cfg, resume)
    cfg.server.api_key = api_key  # after saving: a key from the environment is not written to config.yaml
    connect(cfg)
    import ray  # lazy: optional dependency; connect() said how to install it when missing

    log = MetricsLogger(run_dir, "launcher")
    log.log("run_start", mode=cfg.pipeline.mode, update_mode=cfg.pipeline.update_mode, launcher="ray",
            resumed_from=str(resume_from) if resume_from else None, resumed_step=state.step if state else None)
    actor_resume = ({"next_group": state.next_group, "skipped": state.skipped_groups,
                     "dropped": state.dropped_groups, "version": state.version}
                    if state else None)
    stream = make_stream(cfg.pipeline, name=cfg.name, capacity=staleness(cfg).stream_capacity)
    assert isinstance(stream, RedisStream)  # check_ray_config: pipeline.stream=redis
    stream.reset()  # a resumed run too: groups left by the dead run were made by weights the checkpoint never had
    progress = Progress(cfg, enabled=cfg.pipeline.progress)
    handles: list[Any] = []
    pgs: list[Any] = []

    def start() -> tuple[list[str], Any]:
        servers = start_servers(cfg, str(run_dir), ckpt.model_folder(cfg, resume_from))
        handles.extend(servers)
        asked = {f"server{k}": {"CPU": role_cpus(cfg)[f"server{k}"], **_resources(cfg, f"server{k}"),
                                **({"GPU": 1} if k < len(cfg.pipeline.server_devices) else {})}
                 for k in range(len(servers))}
        try:  # a server Ray cannot place would wait forever: placed() names it and the cluster's resources
            urls = list(placed({f"server{k}": s.url.remote() for k, s in enumerate(servers)},
                               cfg.pipeline.startup_timeout_s, asked).values())
        except RoleFailed:
            raise
        except Exception as exc:
            raise RoleFailed("server", f"inference servers did not start: {type(exc).__name__}: {exc}") from exc
        log.log("servers_ready", urls=urls)
        trainers, trainer_refs, trainer_nodes, pg = start_trainer(cfg, str(run_dir), urls, stream,
                                                                  str(resume_from) if resume_from else None)
        handles.extend(trainers)
        pgs.extend([pg] if pg is not None else [])
        wait_healthy(urls, [], cfg.pipeline.startup_timeout_s, cfg.server.api_key)
        actor = ray.remote(RoleActor).options(name=f"{cfg.name}-actor", num_cpus=role_cpus(cfg)["actor"],
                                              max_restarts=0,
                                              resources=_resources(cfg, "actor")).remote("actor", str(run_dir))
        handles.append(actor)
        names = ["trainer"] + [f"trainer-rank{r}" for r in range(1, len(trainer_refs))]
        node_call = actor.node_id.remote()  # type: ignore[attr-defined]
        actor_node = placed({"actor": node_call}, cfg.pipeline.startup_timeout_s,
                            {"actor": {"CPU": role_cpus(cfg)["actor"], **_resources(cfg, "actor")}})["actor"]
        placement = {**{f"server{k}": n for k, n in enumerate(ray.get([s.node_id.remote() for s in servers]))},
                     **dict(zip(names, trainer_nodes, strict=True)), "actor": actor_node}
        actor_args = (cfg, str(run_dir), urls, stream, actor_resume)
        actor_ref = actor.run.remote("actor_main", actor_args, {})  # type: ignore[attr-defined]
        log.log("roles_started", launcher="ray", servers=urls, trainer_host=cfg.pipeline.weight_sync_host,
                ray_nodes=placement)
        watched = {**dict(zip(names, trainer_refs, strict=True)), "actor": actor_ref}

        def trainer_done() -> bool:
            for name, ref in list(watched.items()):
                done, _ = ray.wait([ref], timeout=0)
                if not done:
                    continue
                try:
                    ray.get(ref)
                except Exception as exc:  # RayActorError (the process died) or the role's own exception
                    raise _role_error(name, exc, str(run_dir), cfg.pipeline.log_tail_lines) from None
                del watched[name]  # the actor and ranks > 0 may finish first
            return "trainer" not in watched

        return urls, trainer_done

    def stop() -> None:
        stream.close()
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        for pg in pgs:
            from ray.util.placement_group import remove_placement_group  # lazy: as ray

            remove_placement_group(pg)
        ray.shutdown()  # disconnects from a running cluster; stops one this process started

    return supervise(cfg, run_dir, log, progress, start, stop)
