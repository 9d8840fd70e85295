"""The best split of N devices between inference servers and the trainer, per mode, by simulation.

Three set-ups are compared, each at its best split:
- pipelined: K servers and T = N - K x (devices per server) trainer devices, running side by side;
- sync, split: the same kind of split, generation and training in turn (inflight's `pipeline.mode: sync`);
- sync, colocated: every device generates (N / devices-per-server servers), then every device trains (T = N), the
  conventional loop of most RL frameworks (the weights move within each device: no push over the network).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from inflight_plan.profile import Profile
from inflight_plan.sim import SimResult, simulate
from inflight_plan.workload import SimConfig


@dataclass
class Choice:
    label: str
    servers: int
    trainer_devices: int
    result: SimResult

    @property
    def samples_per_s(self) -> float:
        return steady(self.result)


def steady(r: SimResult) -> float:
    """Samples/s after the first quarter of the run (whole sync rounds): the pipeline's fill left out."""
    n = r.config.num_grad_steps if r.config.mode == "sync" else 1
    first = n * math.ceil(len(r.step_end_s) / 4 / n)
    return r.steady_samples_per_s(first)


def time_to(r: SimResult, samples: int) -> float:
    """Seconds to train `samples`: simulated while within the run, then extrapolated at the steady rate."""
    t = r.time_to_samples(samples)
    if t is not None:
        return t
    done = r.samples_per_step * len(r.step_end_s)
    return r.wall_s + (samples - done) / steady(r)


def candidates(gpus: int, per_server: int, most: int = 16) -> list[int]:
    """Server counts K with at least one trainer device left: all of them, or `most` spread evenly."""
    top = (gpus - 1) // per_server
    if top < 1:
        raise ValueError(f"{gpus} devices cannot hold one server of {per_server} and a trainer")
    if top <= most:
        return list(range(1, top + 1))
    return sorted({max(1, round(1 + i * (top - 1) / (most - 1))) for i in range(most)})


def _run(profile: Profile, base: SimConfig, mode: str, servers: int, trainer: int) -> SimResult:
    cfg = dataclasses.replace(base, mode=mode, servers=servers, trainer_devices=trainer)
    return simulate(profile, cfg)


def best(profile: Profile, base: SimConfig, gpus: int, mode: str, per_server: int) -> tuple[Choice, list[Choice]]:
    """The split with the most samples/s (coarse grid, then every K next to the best), and all that were tried."""
    tried: dict[int, Choice] = {}

    def at(k: int) -> Choice:
        if k not in tried:
            tried[k] = Choice(mode, k, gpus - k * per_server, _run(profile, base, mode, k, gpus - k * per_server))
        return tried[k]

    grid = candidates(gpus, per_server)
    top = max((at(k) for k in grid), key=lambda c: c.samples_per_s)
    i = grid.index(top.servers)
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    for k in range(lo, hi + 1):
        at(k)
    choices = sorted(tried.values(), key=lambda c: c.servers)
    return max(choices, key=lambda c: c.samples_per_s), choices


def colocated(profile: Profile, base: SimConfig, gpus: int, per_server: int) -> Choice:
    """Sync with every device generating, then every device training; the push is an in-device swap (pause_s)."""
    swap = profile.model_copy(update={"push_s": profile.pause_s})
    k = max(1, gpus // per_server)
    return Choice("sync-colocated", k, gpus, _run(swap, base, "sync", k, gpus))


def plot(path: str, pipelined: list[Choice], sync: list[Choice], coloc: Choice | None, gpus: int, source: str) -> None:
    import matplotlib  # lazy: ~1 s to import; only --plot draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as matplotlib above

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for choices, name in ((pipelined, "pipelined"), (sync, "sync (split)")):
        ax.plot([c.servers for c in choices], [c.samples_per_s for c in choices], marker="o", label=name)
    if coloc is not None:
        ax.axhline(coloc.samples_per_s, color="grey", ls="--", label="sync, colocated")
    ax.set_xlabel(f"inference servers (of {gpus} devices; the rest train)")
    ax.set_ylabel("samples/s (predicted)")
    ax.legend()
    ax.set_title("PREDICTION", fontsize=10)
    b = max(pipelined, key=lambda c: c.samples_per_s).result
    share = b.lag_share()
    bx.bar(list(share), list(share.values()))
    bx.set_xlabel("lag (trainer version - token version)")
    bx.set_ylabel("share of trained tokens")
    bx.set_title(f"best pipelined split: lag (max_lag {b.config.max_lag})", fontsize=10)
    fig.suptitle(f"predicted from profile: {source[:110]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
