"""Roles that share a machine's cores (the CPU set-up: server, trainer and actor on 2 cores) slow each other down;
roles on their own GPUs do not. A profile measured with each role alone (`inflight profile`) then predicts too fast
a pipeline whenever the roles overlap in time.

Model (processor sharing): while the busy roles want D threads on C cores and D > C, each runs at C / D of its own
speed. The simulator records how long each combination of busy threads lasted (Simulator.occupancy: the trainer's,
each server's engine thread and its HTTP thread, the actor; an engine stalled by its HTTP thread's hold on the
interpreter lock still wants a core for the share of the stall it computes, handing the lock back and forth:
Profile.server_http_spin); each role's slowdown is the time-weighted mean of
max(1, D / C) over the time it was busy (a server: either of its threads), times the profile's measured co-run
factor (`trainer_corun` / `server_corun`, corun.py: shared cache and memory bandwidth) over the time the trainer and
a server computed together; the profile's figures are divided by
those slowdowns and the loop simulated again, until the slowdowns settle (a fixed point, damped). Overlap is thus
taken from the simulated loop itself: in sync mode, where generation and training alternate, the trainer runs at
its own speed; pipelined, it shares the cores with the server and the actor. What sharing leaves out, the wait of a
thread that wakes up to find every core taken, the simulator adds itself on a group's path (given `cores`:
Simulator._wake_wait, from the profile's wake-up counts and wait).
"""

from __future__ import annotations

from inflight_plan.profile import DecodeCurve, Profile
from inflight_plan.sim import SimResult, simulate
from inflight_plan.workload import SimConfig


def slowed(profile: Profile, trainer: float, server: float, actor: float) -> Profile:
    """The profile with each role `x` times slower (the push is the trainer's work; what it takes more beside the
    other roles, push_beside_*, was measured beside them and is kept)."""
    e, t = profile.engine, profile.trainer
    curve = DecodeCurve(batches=e.decode.batches, contexts=e.decode.contexts,
                        step_s=[[v * server for v in row] for row in e.decode.step_s])
    return profile.model_copy(update={
        "engine": e.model_copy(update={"decode": curve, "prefill_tokens_per_s": e.prefill_tokens_per_s / server}),
        "trainer": t.model_copy(update={"tokens_per_s": t.tokens_per_s / trainer,
                                        "step_overhead_s": t.step_overhead_s * trainer}),
        "pause_s": profile.pause_s * server, "push_s": profile.push_s * trainer,
        "server_s_per_group": profile.server_s_per_group * server,
        "server_s_per_request": profile.server_s_per_request * server,
        "server_s_per_token": profile.server_s_per_token * server,
        "actor_s_per_group": profile.actor_s_per_group * actor,
        "actor_s_per_token": profile.actor_s_per_token * actor,
        "trainer_s_per_group": profile.trainer_s_per_group * trainer,
        "trainer_s_per_token": profile.trainer_s_per_token * trainer})


def slowdowns(occupancy: dict[tuple[int, int, int, int, int], float], cores: float, trainer_threads: float = 1.0,
              server_threads: float = 1.0, actor_threads: float = 1.0,
              corun: tuple[float, float] = (1.0, 1.0), stalled: float = 0.0) -> tuple[float, float, float]:
    """(trainer, server, actor) slowdowns from the time spent in each (trainer, engines, stalled engines, HTTP
    threads, actor) busy state; `server_threads`: each engine's compute threads; `corun`: the (trainer, server)
    factors while the trainer and an engine both compute (Profile.trainer_corun, server_corun); `stalled`: the share
    of its stall an engine still wants a core (Profile.server_http_spin / server_http_stall)."""
    out = []
    for role in range(3):
        num = den = 0.0
        for (t, e, s, h, a), dt in occupancy.items():
            if (t, e + s + h, a)[role] == 0:  # t counts the trainer's threads at work: compute and the push
                continue
            demand = t * trainer_threads + e * server_threads + s * stalled + h + a * actor_threads
            both = corun[role] if role < 2 and t and e else 1.0
            num += dt * max(1.0, demand / cores) * both
            den += dt
        out.append(num / den if den else 1.0)
    return out[0], out[1], out[2]


def simulate_shared(profile: Profile, cfg: SimConfig, cores: float, trainer_threads: float = 1.0,
                    server_threads: float = 1.0, actor_threads: float = 1.0, passes: int = 8) -> SimResult:
    """simulate() with the roles sharing `cores` cores. The result's extra["slowdown"] gives the settled factors."""
    s: tuple[float, ...] = (1.0, 1.0, 1.0)
    result = simulate(profile, cfg, occupancy=True, cores=cores)
    for _ in range(passes):
        spin = min(1.0, profile.server_http_spin / profile.server_http_stall) if profile.server_http_stall else 0.0
        new = slowdowns(result.extra["occupancy"], cores, trainer_threads, server_threads, actor_threads,
                        (profile.trainer_corun, profile.server_corun), spin)
        s = tuple((a + b) / 2 for a, b in zip(s, new, strict=True))  # damped: the overlap moves with the speeds
        result = simulate(slowed(profile, *s), cfg, occupancy=True, cores=cores)
    result.extra["slowdown"] = dict(zip(("trainer", "server", "actor"), s, strict=True))
    return result
