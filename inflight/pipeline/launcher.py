"""`run_pipeline(cfg)`: the whole pipeline (servers, trainer, actor), started by the launcher that
`pipeline.launcher` names: `local` (processes on this host, local_launcher.py) or `ray` (Ray actors on the hosts of
a cluster, ray_launcher.py). Both share launch_common.py and end in one `supervise` loop.
"""

from __future__ import annotations

from inflight.config import RunConfig
from inflight.pipeline.local_launcher import run_pipeline_local
from inflight.pipeline.ray.launcher import run_pipeline_ray


def run_pipeline(cfg: RunConfig, resume: bool = False) -> int:
    """Run the whole pipeline; returns 0 when the trainer finished, 1 when a role failed, 130 on Ctrl-C.
    `resume`: continue the run in cfg's run folder from its newest checkpoint (docs/reliability.md)."""
    if cfg.pipeline.launcher == "local":
        return run_pipeline_local(cfg, resume=resume)
    if cfg.pipeline.launcher == "ray":
        return run_pipeline_ray(cfg, resume=resume)
    raise ValueError(f"pipeline.launcher must be 'local' or 'ray', got {cfg.pipeline.launcher!r}")
