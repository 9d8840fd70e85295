from dataclasses import dataclass


@dataclass
class ActorConfig:
    group_size: int = 8  # G samples per prompt
    groups_per_step: int = 16  # prompts per optimizer step
    max_lag: int = 1  # staleness bound, in weight versions (sync mode applies num_grad_steps - 1: config/limits.py)
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    use_n: bool = True  # one request with n=G, else G requests
    concurrency_per_server: int = 64  # outstanding requests per server (x group_size sequences with use_n)
    request_timeout_s: float = 120.0
    retries: int = 5
    backoff_s: float = 0.2  # first retry delay; doubles each retry
    probe_interval_s: float = 0.5  # how often a server out of rotation is probed (GET /health)
    adapter: str = "builtin"  # response shape: a backend's name (inflight/backends.py; parsers: actor/response_parsers.py)
    eval_every: int = 10  # trainer steps between held-out evaluations (0 = never)
    # with eval_every > 0, a fresh run first evaluates the starting weights, before any rollout (so every token of
    # it is version 0): the base model's held-out accuracy, logged as an eval record with base=true
    eval_base: bool = True
    eval_temperature: float = 0.0
    eval_max_new_tokens: int = 0  # 0 = max_new_tokens
    eval_samples: int = 6  # held-out replies (the first problems) recorded per evaluation, shown in the report
    eval_priority: int = 1  # built-in servers start waiting rollouts (priority 0) before evaluation requests
    # the base and the final evaluations score the whole held-out split; in-run ones a window rotating over it
    # a run's best accuracy then counts runs of consecutive subsets that together score the whole split
    eval_subset: int = 0  # problems per in-run evaluation, rotating over the held-out split (0 = all of it)
    # requests carry min_weight_version (the oldest weights the staleness bound allows), which inflight's servers
    # honour by holding the request until they have it; the trainer then publishes a version as soon as it is
    # trained, not after its push (set false for a server that ignores the field; off for adapter vllm | sglang)
    version_gate: bool = True
    # With the gate, the servers hold requests sent early: they start at the pause that brings their weights, not
    # after the trainer's publish, the actor's wake-up and a round trip. The tokens' lag bound is unchanged.
    queue_ahead: int = 1  # gated: steps of groups sent beyond the staleness bound, held by the servers (0 = none)
    reward_timeout_s: float = 10.0
    reward_workers: int = 2
    metrics_interval_s: float = 2.0  # how often the actor reports its metrics
    max_failed_in_a_row: int = 50  # this many groups failing one after another stop the actor (0 = never)
    # DAPO's dynamic sampling (algo/dynamic_sampling.py); queue_ahead is then 0 (a refill moves later groups into
    # earlier steps, so none may wait at a server for a later version)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and start fresh prompts in their place, so every step trains groups_per_step groups with a signal; use it when many groups are all right or all wrong (steps shrink without it)
    dynamic_sampling_max_tries: int = 10  # dynamic sampling: tries per place in a step; the last try's group is trained even if its rewards are all equal (logged as capped), so a solved task never stalls the run (0 = no limit)

    def __post_init__(self) -> None:
        if self.eval_subset < 0:
            raise ValueError(f"actor.eval_subset must be >= 0 (0 = the whole held-out split), not {self.eval_subset}")
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError("actor.dynamic_sampling needs actor.group_size >= 2 (a group of one always has equal "
                             "rewards)")
        if self.dynamic_sampling_max_tries < 0:
            raise ValueError("actor.dynamic_sampling_max_tries must be >= 0 (0 = no limit), "
                             f"not {self.dynamic_sampling_max_tries}")

    @property
    def gated(self) -> bool:
        """Whether the servers enforce the staleness bound per request (min_weight_version)."""
        return self.version_gate and self.adapter == "builtin"
