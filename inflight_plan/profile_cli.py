"""`inflight profile CONFIG.yaml [key=value ...] --out PROFILE.json`: measure this machine for `inflight plan`.

Measures, with the config's model and thread settings: the built-in engine's decode step time over --batches and
--contexts and its prefill tokens/s, how much more a step costs under the config's traffic (traffic.py), the pause
of a weight swap, the push, the per-group reply work (server reply, actor, stream read: inflight_plan/reply.py),
and the trainer's tokens/s and optimizer step; or, with --server URL, the step-time curve of that running server
(vLLM, SGLang, inflight serve) over HTTP, with the trainer measured here unless --no-trainer. The JSON says where
and when it was measured.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

from inflight import backends
from inflight.config import ConfigError, RunConfig, load_config
from inflight_plan.profile import Profile, TrainerProfile


def _ints(text: str) -> list[int]:
    try:
        vals = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError("values must be >= 1")
    return vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config (YAML): model path, server and trainer threads, batch")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=runs/models/tiny")
    parser.add_argument("--out", required=True, help="where to write the profile (JSON)")
    parser.add_argument("--batches", type=_ints, default=None, help="decode batch sizes (default 1,8,32,...,max_batch)")
    parser.add_argument("--contexts", type=_ints, default=None, help="contexts in tokens (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per decode point and prefill (median)")
    parser.add_argument("--server", default="", help="time a running OpenAI-compatible server at this URL instead")
    parser.add_argument("--no-trainer", action="store_true", help="with --server: trainer figures from --tokens-per-s")
    parser.add_argument("--tokens-per-s", type=float, default=0.0, help="trainer tokens/s when not measured")
    parser.add_argument("--push-s", type=float, default=None,
                        help="seconds from optimizer step to every server holding the weights (default: measured "
                             "here, pushes of the model to a real `inflight serve` with the config's transport; with "
                             "--server: the engine's pause)")
    parser.add_argument("--overhead-s", type=float, default=0.0,
                        help="per group: latency from its last token to the trainer (network, stream)")
    parser.add_argument("--actor-s-per-group", type=float, default=None,
                        help="per group: the actor's serial seconds (reply decoding, rewards, stream put); default: "
                             "measured with the reply work (0 with --server or --no-reply)")
    parser.add_argument("--no-reply", action="store_true",
                        help="do not time the per-group reply work (server reply, actor, stream read) on the real "
                             "server and actor code")
    parser.add_argument("--reply-lengths", type=_ints, default=None,
                        help="two completion lengths the reply work is timed at (default max_new_tokens/4,"
                             "max_new_tokens)")
    parser.add_argument("--no-corun", action="store_true",
                        help="do not measure how much the trainer and a server slow each other computing at once on "
                             "this machine (corun.py; measured by default with the built-in engine)")
    parser.add_argument("--no-traffic", action="store_true",
                        help="do not time the engine's steps under the config's traffic (groups joining a running "
                             "batch, real stops) against plain decode steps (traffic.py; measured by default with "
                             "the built-in engine)")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="trainer measurement: prompt tokens per group")
    parser.add_argument("--completion-tokens", type=int, default=12, help="trainer measurement: tokens per completion")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(RunConfig, args.config, args.overrides)
    except (ConfigError, OSError) as exc:
        print(f"inflight profile: {exc}", file=sys.stderr)
        return 2
    if args.no_trainer and args.tokens_per_s <= 0:
        print("inflight profile: --no-trainer needs --tokens-per-s", file=sys.stderr)
        return 2
    if cfg.trainer.backend != "single" and not args.no_trainer:
        print("inflight profile: the trainer is measured with trainer.backend=single only; for fsdp2 give its "
              "tokens/s from a short run: --no-trainer --tokens-per-s X", file=sys.stderr)
        return 2
    from inflight_plan import measure  # lazy: loads torch and the engine (seconds); `profile --help` needs neither

    mb = cfg.server.max_batch
    batches = args.batches or sorted({1, *[b for b in (8, 32, 64, 128, 256) if b < mb], mb})
    contexts = args.contexts or [32]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    pause = 0.0
    if args.server:
        engine = measure.measure_server(args.server, batches, contexts, api_key=cfg.server.api_key,
                                        repeats=args.repeats)
    else:
        engine, pause = measure.measure_engine(cfg.model.path, batches, contexts, threads=cfg.server.threads,
                                               precision=cfg.server.generator_precision, repeats=args.repeats,
                                               max_model_len=cfg.server.max_model_len)
    step_ms = dict(zip(batches, (round(v * 1e3, 2) for v in engine.decode.step_s[0]), strict=True))
    print(f"engine: decode step {step_ms} ms "
          f"at context {contexts[0]}; prefill {engine.prefill_tokens_per_s:.0f} tok/s; pause {pause * 1e3:.1f} ms")
    if not (args.server or args.no_traffic):
        from inflight_plan.traffic import measure_run_step_factor  # lazy: loads torch and the engine (seconds)

        engine.run_step_factor, d = measure_run_step_factor(cfg, engine)
        print(f"engine under the config's traffic: steps {engine.run_step_factor:.2f}x plain decode steps at batch "
              f"{d['batch']:.0f}, context {d['context']:.0f} ({d['prefill_share']:.0%} of tokens prefill)")
    push = args.push_s
    if push is None and not args.server and cfg.trainer.protocol == "inflight":
        push, pause = measure.measure_push(cfg)
        print(f"push: {push * 1e3:.1f} ms ({cfg.trainer.weight_transport}), server pause {pause * 1e3:.1f} ms")
    reply: dict[str, float] = {}
    if not args.server and not args.no_reply and cfg.server.engine == backends.BUILTIN:
        from inflight_plan.corun import measure_wakeup_wait  # lazy: loads torch and the engine (seconds)

        reply = measure_reply(cfg, args.reply_lengths)
        reply["wakeup_wait_s"] = measure_wakeup_wait()
        print(f"a thread waking up while every core is taken waits {reply['wakeup_wait_s'] * 1e3:.3f} ms for one")
    if args.actor_s_per_group is not None:
        reply.update(actor_s_per_group=args.actor_s_per_group, actor_s_per_token=0.0)
    if args.no_trainer:
        trainer = TrainerProfile(model=cfg.model.path, tokens_per_s=args.tokens_per_s)
    else:
        trainer = measure.measure_trainer(cfg.model.path, cfg.trainer, cfg.actor.group_size, cfg.actor.groups_per_step,
                                          prompt=args.prompt_tokens, completion=args.completion_tokens)
        print(f"trainer: {trainer.tokens_per_s:.0f} tok/s, optimizer step {trainer.step_overhead_s * 1e3:.1f} ms, "
              f"cost per token +{trainer.length_slope:.2%} per completion token")
    if not (args.server or args.no_trainer or args.no_corun) and cfg.server.engine == backends.BUILTIN:
        reply.update(measure_corun(cfg, args.prompt_tokens, args.completion_tokens,
                                   push=push is not None and args.push_s is None))
    prof = Profile(source=f"measured by `inflight profile {args.config}` on {platform.node()} ({platform.machine()}, "
                          f"{platform.processor() or 'cpu'}) at {when}",
                   notes=f"server threads {cfg.server.threads}, trainer threads {cfg.trainer.threads}, trainer "
                         f"measured on {args.prompt_tokens}-token prompts, {args.completion_tokens}-token completions, "
                         f"trainer device {cfg.trainer.device}; wall-clock, other load on the machine included",
                   engine=engine, trainer=trainer, pause_s=pause,
                   push_s=pause if push is None else push, overhead_s=args.overhead_s, **reply)
    print(f"profile written to {prof.save(args.out)}")
    return 0


def measure_corun(cfg, prompt: int, completion: int, push: bool) -> dict[str, float]:
    """Profile.trainer_corun / server_corun: the trainer's step beside a server decoding a step's batch, and back;
    with `push`, also what a push takes more beside each and beside both (push_beside_*_s)."""
    from inflight_plan.corun import measure_interference, measure_push_beside  # lazy: as measure in run()
    from inflight_plan.measure import trainer_bench  # lazy: loads torch and the engine (seconds)

    step, _ = trainer_bench(cfg.model.path, cfg.trainer, cfg.actor.group_size, cfg.actor.groups_per_step,
                            prompt=prompt, completion=completion)
    batch = min(cfg.server.max_batch, cfg.actor.group_size * cfg.actor.groups_per_step)
    trainer, server = measure_interference(cfg, lambda: sum(step()), batch)
    print(f"co-run: the trainer {trainer:.2f}x slower beside a server decoding {batch} sequences, the server "
          f"{server:.2f}x slower beside the trainer")
    out = {"trainer_corun": trainer, "server_corun": server}
    if push:
        beside = measure_push_beside(cfg, lambda: sum(step()), batch)
        print(f"push beside: training +{beside['push_beside_train_s'] * 1e3:.1f} ms, decoding "
              f"+{beside['push_beside_decode_s'] * 1e3:.1f} ms, both +{beside['push_beside_both_s'] * 1e3:.1f} ms "
              "(less half a decode step where the server decodes)")
        out.update(beside)
    return out


def measure_reply(cfg, lengths: list[int] | None) -> dict[str, float]:
    """The per-group reply work (inflight_plan/reply.py) as profile fields; the reward workers count as actor."""
    from inflight_plan.reply import line, measure_reply as measure  # lazy: loads torch and the actor (seconds)

    if lengths is not None and len(lengths) != 2:
        raise SystemExit("inflight profile: --reply-lengths takes two lengths, e.g. 4,12")
    (lo, hi), request_s, lock = measure(cfg, (lengths[0], lengths[1]) if lengths else None)
    print(f"requests arriving (held at the version gate): server {request_s * 1e3:.2f} ms per group (CPU time)")
    if lock is not None:
        print(f"the server's HTTP work beside decoding: per second of it the engine thread loses {lock[0]:.2f} s and "
              f"computes {lock[1]:.2f} s (the interpreter lock)")
    for c in (lo, hi):
        print(f"reply work at {c.length} tokens x {c.group_size} ({c.groups} groups, {c.wall_s:.2f} s): per group "
              f"server {c.server_s * 1e3:.2f} ms, actor {c.actor_s * 1e3:.2f} ms + reward workers "
              f"{c.reward_s * 1e3:.2f} ms, trainer stream read {c.trainer_s * 1e3:.2f} ms (CPU time)")
    for c in (lo, hi):
        c.actor_s += c.reward_s
    out = {"actor_wakeups_per_group": (lo.actor_wakeups + hi.actor_wakeups) / 2,
           "server_wakeups_per_group": (lo.server_wakeups + hi.server_wakeups) / 2}
    print(f"woken per group: the actor's loop {out['actor_wakeups_per_group']:.1f} times, the server's HTTP thread "
          f"{out['server_wakeups_per_group']:.1f}")
    for role in ("server", "actor", "trainer"):
        out[f"{role}_s_per_group"], out[f"{role}_s_per_token"] = line(lo, hi, f"{role}_s")
    # the server's fixed part, split: what the requests cost when they arrive, the rest when the group is answered
    out["server_s_per_request"] = min(request_s, out["server_s_per_group"])
    out["server_s_per_group"] -= out["server_s_per_request"]
    if lock is not None:
        out["server_http_stall"], out["server_http_spin"] = lock
    return out
