"""The actor: asynchronous rollouts over several inference servers, rewards, the staleness bound, evaluation.

    ServerPool     route requests (least outstanding, per-server limit, retries, health probes)   server_pool.py
    default_rollout / RolloutClient   the user's extension point                                 rollout.py
    Actor          one coroutine per group, staleness bound, stream, metrics, generate_round     actor.py
    evaluate       held-out pass@1 / mean reward through the same servers                        evaluate.py
    run_actor / open_actor   the actor as a process (pipeline launcher), or inside a loop         run.py
"""

from inflight.actor.actor import Actor, ActorMetrics
from inflight.actor.evaluate import evaluate
from inflight.actor.response_parsers import Completion, ResponseError, get_adapter
from inflight.actor.rollout import RolloutClient, default_rollout
from inflight.actor.run import open_actor, run_actor
from inflight.actor.server_pool import BadRequest, RequestFailed, ServerPool
from inflight.config.actor import ActorConfig
from inflight.config.limits import pipeline_limits

__all__ = [
    "Actor", "ActorConfig", "ActorMetrics", "BadRequest", "Completion", "RequestFailed", "ResponseError",
    "RolloutClient", "ServerPool", "default_rollout", "evaluate", "get_adapter", "open_actor", "pipeline_limits",
    "run_actor",
]
