"""Config checks of `trainer.weight_transport` that need the whole run config: `cuda_ipc` shares the trainer's
device buffer by handle, so every server must be a built-in server started by the launcher on the trainer's own
device (or, with a CPU trainer, on the CPU: the shared-memory stand-in). There is no `auto` transport: a run on one
GPU that puts trainer and servers on the same device sets cuda_ipc itself (docs/configuration.md)."""

from __future__ import annotations

from inflight.config import RunConfig

TRANSPORTS = ("process_group", "shm", "file", "cuda_ipc")


def check_weight_transport(cfg: RunConfig) -> None:
    """Raise ValueError naming the setting that rules the chosen transport out."""
    t, p, s = cfg.trainer, cfg.pipeline, cfg.server
    if t.weight_transport not in TRANSPORTS:
        raise ValueError(f"trainer.weight_transport must be one of {', '.join(TRANSPORTS)}, got "
                         f"{t.weight_transport!r}")
    if t.weight_transport != "cuda_ipc":
        return
    why = "trainer.weight_transport=cuda_ipc shares the trainer's device buffer with servers on that device"
    if s.engine != "builtin" or t.protocol != "inflight":
        raise ValueError(f"{why}: it needs the built-in engine and protocol (server.engine=builtin, "
                         f"trainer.protocol=inflight; got {s.engine}, {t.protocol}); use process_group")
    if p.server_urls or p.launcher != "local":
        raise ValueError(f"{why}: it needs servers the local launcher starts (no pipeline.server_urls, "
                         "pipeline.launcher=local), so that their device is known; use process_group")
    n = s.num_servers
    if str(t.device).startswith("cuda"):
        if str(t.device) not in ("cuda", "cuda:0"):
            raise ValueError(f"{why}: set the trainer's GPU with pipeline.trainer_devices, and trainer.device=cuda "
                             f"(got {t.device})")
        trainer_gpu = p.trainer_devices
        if not trainer_gpu or "," in trainer_gpu or len(p.server_devices) < n:
            raise ValueError(f"{why}: set pipeline.trainer_devices to one GPU and pipeline.server_devices to that "
                             f"GPU for each of the {n} servers (got trainer_devices={trainer_gpu!r}, "
                             f"server_devices={list(p.server_devices)})")
        other = [f"server {k} on {d!r}" for k, d in enumerate(p.server_devices[:n]) if str(d) != trainer_gpu]
        if other:
            raise ValueError(f"{why}: the trainer is on GPU {trainer_gpu!r}, {', '.join(other)}; use "
                             "trainer.weight_transport=process_group (NCCL) between devices")
        return
    if p.server_devices[:n]:
        raise ValueError(f"{why}: the trainer is on the CPU ({t.device}) and servers on GPUs "
                         f"{list(p.server_devices[:n])}; use process_group")
