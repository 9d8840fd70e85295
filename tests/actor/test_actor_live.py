"""The actor against a real `inflight serve` (tiny random model): groups, tokens as sampled, reward labels, the
staleness bound with a trainer stub pushing real weight updates, evaluation, sync rounds, run_actor."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import threading

import pytest
import torch

from inflight.actor import Actor, ActorConfig, ServerPool, default_rollout, evaluate, run_actor
from inflight.config import RunConfig
from inflight.contracts import Verdict
from inflight.engine.serve import ServerProcess
from inflight.streams import MemoryStream
from inflight.tasks import TaskConfig, get_task
from tests.actor.helpers import TrainerStub, set_version

pytestmark = pytest.mark.slow  # starts an inference server (~10-20 s on a busy 2-core machine)

TASK_CFG = TaskConfig(name="arith", eval_size=8)


@pytest.fixture(scope="module")
def rewards():
    from inflight.rewards import RewardService

    with RewardService(TASK_CFG, workers=1, timeout_s=10.0) as r:
        yield r


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(str(tiny_model_dir), extra_args=["--threads", "1", "--max-model-len", "256"]) as s:
        yield s


@pytest.fixture(scope="module")
def weights_file(tiny_model_dir, tmp_path_factory):
    """A partial update that leaves the model's outputs unchanged (final norm weight = its value, ones)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("w") / "norm.safetensors"
    save_file({"model.norm.weight": torch.ones(64)}, str(path))
    return str(path)


def actor_cfg(**kw) -> ActorConfig:
    base = dict(group_size=3, groups_per_step=2, max_new_tokens=8, concurrency_per_server=8, retries=3,
                backoff_s=0.05, probe_interval_s=0.1, eval_every=0, metrics_interval_s=60.0)
    return ActorConfig(**{**base, **kw})


def new_stream() -> MemoryStream:
    return MemoryStream(capacity=256, ctx=mp.get_context("spawn"))


def drain(stream, n: int) -> list:
    out: list = []
    while len(out) < n:
        got = stream.get(n - len(out), timeout_s=5)
        assert got, f"stream ran dry after {len(out)} of {n} groups"
        out += got
    return out


def _ref_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """float64 reference: log p(completion[t] | prompt + completion[:t]) at temperature 1."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    P = len(prompt)
    return [lp[P - 1 + t, tok].item() for t, tok in enumerate(completion)]


@pytest.mark.parametrize("use_n", [True, False])
def test_groups_are_exactly_what_the_server_sampled(server, rewards, tiny_model_dir, weights_file, use_n):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    set_version([server.url], weights_file, 0, new_run=True)
    task, cfg, stream = get_task(TASK_CFG), actor_cfg(use_n=use_n), new_stream()
    stream.publish_version(0)

    async def main():
        pool = ServerPool([server.url], retries=2)
        try:
            actor = Actor(cfg, task, pool, rewards, stream)
            return await actor.generate_round(3)
        finally:
            await pool.aclose()

    groups = asyncio.run(main())
    assert drain(stream, 3) == groups  # what went into the stream is what came back (msgpack round trip)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float64).eval()
    prompts = {ts.id: ts for ts in itertools.islice(task.train_samples(0), 3)}
    assert [g[0].task_id for g in groups] == list(prompts)  # prompts in order, one group each
    assert len({g[0].group_id for g in groups}) == 3
    for g in groups:
        assert len(g) == cfg.group_size and len({s.group_id for s in g}) == 1
        ts = prompts[g[0].task_id]
        want_prompt = tok.apply_chat_template(ts.messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        for s in g:
            assert s.prompt_ids == list(want_prompt)
            assert 1 <= len(s.completion_ids) <= cfg.max_new_tokens
            assert len(s.logprobs) == len(s.versions) == len(s.completion_ids)
            assert s.versions == [0] * len(s.completion_ids) and s.first_version == s.last_version == 0
            assert s.meta["text"] == tok.decode(s.completion_ids, skip_special_tokens=True)
            ref = _ref_logprobs(model, s.prompt_ids, s.completion_ids)
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-3
            v = task.verify(s.meta["text"], ts, s.finish_reason)
            assert s.label == v.label.value and s.reward == v.reward
            assert s.label in ("wrong", "no_answer", "truncated")  # a random model does not do arithmetic


def test_known_completion_through_the_actor_is_labelled_correct(server, rewards, tiny_model_dir):
    """A user rollout (the extension point) adds a demonstration whose text is the gold answer: the actor's
    scoring must label it correct (reward 1) and the sampled ones not."""
    from transformers import AutoTokenizer

    from inflight.actor.response_parsers import Completion

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task, cfg, stream = get_task(TASK_CFG), actor_cfg(), new_stream()

    async def with_demo(ts, client, cfg):
        samples = await default_rollout(ts, client, cfg)
        text = f"\\boxed{{{ts.answer}}}"
        ids = tok.encode(text, add_special_tokens=False)
        demo = Completion(text, samples[0].prompt_ids, ids, [0.0] * len(ids), [0] * len(ids), "stop")
        wrong = Completion("\\boxed{-1}", samples[0].prompt_ids, [5], [0.0], [0], "stop")
        return samples + [client.to_sample(ts, demo), client.to_sample(ts, wrong)]

    async def main():
        pool = ServerPool([server.url])
        try:
            return await Actor(cfg, task, pool, rewards, stream, rollout=with_demo).generate_round(2, put=False)
        finally:
            await pool.aclose()

    for g in asyncio.run(main()):
        assert len(g) == cfg.group_size + 2
        assert (g[-2].label, g[-2].reward) == (Verdict.correct.value, 1.0)
        assert (g[-1].label, g[-1].reward) == (Verdict.wrong.value, 0.0)
        assert all(s.label != "correct" for s in g[:-2])


@pytest.mark.parametrize("max_lag,ahead", [(0, 0), (1, 0), (4, 0), (0, 1), (1, 1)])
def test_staleness_bound_with_a_trainer_pushing_updates(server, rewards, weights_file, max_lag, ahead):
    """AReaL's bound on the groups started (plus `queue_ahead` steps whose requests the server holds) and, either
    way, no trained token more than max_lag versions older than the weights it is trained on."""
    gps, steps = 2, (7 if max_lag == 4 else 4)
    task, stream = get_task(TASK_CFG), new_stream()
    cfg = actor_cfg(max_lag=max_lag, groups_per_step=gps, queue_ahead=ahead)
    stub = TrainerStub(stream, [server.url], gps, steps, weights_file).start()

    async def main():
        pool = ServerPool([server.url])
        try:
            actor = Actor(cfg, task, pool, rewards, stream, max_groups=gps * steps)
            await actor.run()
            return actor
        finally:
            await pool.aclose()

    actor = asyncio.run(main())
    stub.join()
    bound = (max_lag + 1 + ahead) * gps
    assert actor.metrics.groups_completed == gps * steps and actor.metrics.groups_failed == 0
    # AReaL's rule at every start; consumed groups when version tv was published = tv * gps exactly (stub)
    in_flight_at_start = [i + 1 - tv * gps for i, tv in actor.start_log]
    assert all(i < (tv + max_lag + 1 + ahead) * gps for i, tv in actor.start_log)
    assert max(in_flight_at_start) == bound  # the bound is reached (the actor is not just slow) ...
    assert all(n <= bound for n in in_flight_at_start)  # ... and never exceeded
    assert len(stub.consumed) == gps * steps
    for v, g in stub.consumed:
        for s in g:
            start = s.meta["start_version"]
            assert 0 <= v - start <= max_lag + ahead  # started early, held by the server ...
            assert 0 <= v - s.first_version <= max_lag  # ... so that every token's lag stays within the bound
            assert s.versions == sorted(s.versions) and start <= s.first_version and s.last_version <= v
            if max_lag == 0:
                assert set(s.versions) == {v}  # strictly on-policy: lag-0 tokens only
    if max_lag == 4:
        assert max(v - s.meta["start_version"] for v, g in stub.consumed for s in g) >= 1  # off-policy happened


def test_evaluate_greedy_is_repeatable_and_tagged(server, rewards):
    task, cfg = get_task(TASK_CFG), actor_cfg(eval_temperature=0.0)

    async def main():
        pool = ServerPool([server.url])
        try:
            return [await evaluate(task, pool, cfg, rewards=rewards) for _ in range(2)]
        finally:
            await pool.aclose()

    a, b = asyncio.run(main())
    assert a["num_problems"] == 8 and a["num_failed"] == 0 and sum(a["labels"].values()) == 8
    assert a["labels"] == b["labels"] and a["pass@1"] == b["pass@1"]  # greedy: same answers twice
    assert a["pass@1"] == a["labels"].get("correct", 0) / 8 and a["mean_reward"] == a["pass@1"]
    assert a["version_min"] == a["version_max"] >= 0


def test_evaluation_counts_only_finished_replies(server):
    """A verifier that calls every reply correct: held-out accuracy still counts only the replies that ended (EOS)
    within the limit; the first eval_samples replies come back as text with their endings and verdicts."""
    from inflight.contracts import Verification

    class Lenient:
        name = "lenient"

        def __init__(self):
            self.task = get_task(TASK_CFG)

        def eval_samples(self):
            return self.task.eval_samples()

        def verify(self, completion, sample, finish_reason="stop"):
            return Verification(1.0, Verdict.correct)

    cfg = actor_cfg(eval_temperature=1.0, eval_max_new_tokens=3, eval_samples=5)

    async def main():
        pool = ServerPool([server.url])
        try:
            return await evaluate(Lenient(), pool, cfg)
        finally:
            await pool.aclose()

    res = asyncio.run(main())
    cut = res["labels"].get("truncated", 0)
    assert cut + res["labels"].get("correct", 0) == 8 and 0 < cut  # a random model rarely ends in 3 tokens
    assert res["truncated_frac"] == cut / 8 and res["pass@1"] == 1 - cut / 8
    assert res["completion_len_max"] <= 3 and 1 <= res["completion_len_mean"] <= 3
    assert len(res["replies"]) == 5
    for r in res["replies"]:
        assert r["label"] == ("truncated" if r["finish"] == "length" else "correct") and r["tokens"] <= 3
        assert r["prompt"] in {s.messages[-1]["content"] for s in get_task(TASK_CFG).eval_samples()[:5]}


def test_run_actor_entry_point_stops_at_pipeline_limits(server, weights_file):
    cfg = RunConfig(task=TASK_CFG, actor=actor_cfg(eval_every=1))
    cfg.pipeline.max_steps = 3
    stream, events, stop = new_stream(), [], threading.Event()
    stub = TrainerStub(stream, [server.url], 2, 3, weights_file).start()
    final = run_actor(cfg, [server.url], stream, stop, events.append)
    stub.join()
    assert final["actor/groups_completed"] == 6 and final["actor/groups_failed"] == 0 and final["failures"] == []
    evals = [e for e in events if e["kind"] == "eval"]
    assert evals and all(e["num_problems"] == 8 for e in evals)
    # the base model first, before any rollout: every scored token from the starting weights
    assert evals[0]["base"] and evals[0]["version_min"] == evals[0]["version_max"] == 0
    assert not any(e["base"] for e in evals[1:])
    assert events[-1]["kind"] == "actor" and events[-1]["actor/samples"] == 6 * 3


def test_server_killed_mid_run_all_groups_complete_on_the_other(server, rewards, tiny_model_dir):
    task, stream = get_task(TASK_CFG), new_stream()
    cfg = actor_cfg(max_lag=100, max_new_tokens=32, use_n=False, concurrency_per_server=2, request_timeout_s=20)
    stream.publish_version(0)
    with ServerProcess(str(tiny_model_dir), extra_args=["--threads", "1", "--max-model-len", "256"]) as victim:

        async def main():
            pool = ServerPool([server.url, victim.url], retries=4, backoff_s=0.05, probe_interval_s=0.2,
                              request_timeout_s=20)
            killed_with_outstanding = -1

            async def killer():
                nonlocal killed_with_outstanding
                b = pool.servers[1]
                while not (b.completed >= 1 and b.outstanding > 0):
                    await asyncio.sleep(0.005)
                killed_with_outstanding = b.outstanding
                victim.proc.kill()  # no goodbye: connections reset mid-request

            try:
                actor = Actor(cfg, task, pool, rewards, stream, max_groups=10)
                k = asyncio.create_task(killer())
                await actor.run()
                await k
                return actor, pool, killed_with_outstanding
            finally:
                await pool.aclose()

        actor, pool, outstanding_at_kill = asyncio.run(main())
    assert outstanding_at_kill >= 1  # requests were in flight on the killed server
    assert actor.metrics.groups_completed == 10 and actor.metrics.groups_failed == 0 and not actor.failures
    assert not pool.servers[1].healthy and pool.servers[1].errors >= 1
    groups = drain(stream, 10)
    assert sorted(g[0].meta["group_index"] for g in groups) == list(range(10))
    assert all(len(g) == cfg.group_size for g in groups)


def test_stop_event_ends_the_run_and_accounts_for_every_group(server, rewards):
    task, stream, stop = get_task(TASK_CFG), new_stream(), threading.Event()
    cfg = actor_cfg(max_lag=3, max_new_tokens=16, queue_ahead=0)
    stream.publish_version(0)  # no trainer: the bound allows (0 + 3 + 1) * 2 = 8 groups, then the actor waits

    async def main():
        pool = ServerPool([server.url])
        try:
            actor = Actor(cfg, task, pool, rewards, stream)
            run = asyncio.create_task(actor.run(stop))
            while actor.metrics.groups_completed < 2:
                await asyncio.sleep(0.01)
            stop.set()
            return actor, await run
        finally:
            await pool.aclose()

    actor, final = asyncio.run(main())
    m = actor.metrics
    assert m.groups_started == 8 and m.groups_completed >= 2 and m.groups_failed == 0
    assert m.groups_completed + m.groups_cancelled == 8 and m.in_flight == 0 and final["actor/groups_in_flight"] == 0
    assert stream.produced == m.groups_completed


def test_groups_failing_in_a_row_stop_the_actor(rewards):
    """A rollout that always fails ends the run with its error after max_failed_in_a_row groups, instead of
    starting fresh prompts forever."""
    calls = []

    async def broken(ts, client, cfg):
        calls.append(ts.id)
        raise KeyError("no such field")

    async def main():
        pool = ServerPool(["http://127.0.0.1:9"])  # never contacted
        try:
            actor = Actor(actor_cfg(max_failed_in_a_row=7), get_task(TASK_CFG), pool, rewards, new_stream(),
                          rollout=broken)
            actor.stream.publish_version(0)
            with pytest.raises(RuntimeError, match=r"\d+ groups failed in a row; the last: KeyError: 'no such field'"):
                await asyncio.wait_for(actor.run(), 30)
            return actor
        finally:
            await pool.aclose()

    actor = asyncio.run(main())
    bound = actor.bound(0)  # at most one bound's worth more started
    assert 7 <= actor.metrics.groups_failed == len(calls) <= 7 + bound


def test_evaluation_subset_rotates_over_the_split_with_its_stderr(server, rewards):
    """subset=3 of 8 problems: rounds 0, 1, 2 score windows [0..2], [3..5], [6, 7, 0], together the whole split; each
    reports the binomial standard error of its own accuracy, and a greedy reply is the one the full evaluation gave."""
    import math

    task, cfg = get_task(TASK_CFG), actor_cfg(eval_temperature=0.0, eval_samples=8)
    prompts = [s.messages[-1]["content"] for s in task.eval_samples()]

    async def main():
        pool = ServerPool([server.url])
        try:
            full = await evaluate(task, pool, cfg, rewards=rewards)
            return full, [await evaluate(task, pool, cfg, rewards=rewards, subset=3, round_index=r)
                          for r in range(3)]
        finally:
            await pool.aclose()

    full, parts = asyncio.run(main())
    assert full["num_problems"] == full["split_size"] == 8 and full["subset_start"] == 0
    assert [p["subset_start"] for p in parts] == [0, 3, 6]
    seen = []
    for p, want in zip(parts, ([0, 1, 2], [3, 4, 5], [6, 7, 0]), strict=True):
        assert p["num_problems"] == 3 and p["split_size"] == 8
        assert [r["prompt"] for r in p["replies"]] == [prompts[i] for i in want]
        seen += [r["prompt"] for r in p["replies"]]
        acc = p["labels"].get("correct", 0) / 3
        assert p["pass@1"] == acc and p["stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / 3), abs=1e-12)
    assert set(seen) == set(prompts)
    by_prompt = {r["prompt"]: r["reply"] for r in full["replies"]}
    assert all(r["reply"] == by_prompt[r["prompt"]] for p in parts for r in p["replies"])  # greedy, same weights
    acc = full["pass@1"]
    assert full["stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / 8), abs=1e-12)


def test_run_actor_evaluates_rotating_subsets_after_a_full_base(server, weights_file):
    cfg = RunConfig(task=TASK_CFG, actor=actor_cfg(eval_every=1, eval_subset=3))
    cfg.pipeline.max_steps = 3
    stream, events, stop = new_stream(), [], threading.Event()
    stub = TrainerStub(stream, [server.url], 2, 3, weights_file).start()
    run_actor(cfg, [server.url], stream, stop, events.append)
    stub.join()
    evals = [e for e in events if e["kind"] == "eval"]
    assert evals[0]["base"] and evals[0]["num_problems"] == 8  # the base model on the whole split
    runs = evals[1:]
    assert runs and all(e["num_problems"] == 3 for e in runs)
    assert [e["subset_start"] for e in runs] == [(3 * k) % 8 for k in range(len(runs))]  # consecutive windows
