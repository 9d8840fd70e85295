"""`inflight` console script. Each subcommand lives in its role's module, which exposes
`add_arguments(parser)` and `run(args) -> int | None`; modules are imported only when their command runs."""

from __future__ import annotations

import argparse
import importlib
import sys

from inflight import backends

COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("inflight.modelkit.cli", "train a tokenizer for a task and build a small causal LM from a config"),
    "get-model": ("inflight.modelkit.fetch", "a pretrained model (e.g. smollm2-135m-instruct) or a GGUF file as a plain HF folder"),
    "sft": ("inflight.trainer.sft", "supervised warm start on generated solutions (sets the starting accuracy)"),
    "serve": ("inflight.engine.serve", "run an inference server (built-in engine, vLLM or SGLang) with the contract"),
    "train": ("inflight.pipeline.train", "run the whole RL pipeline from a YAML config (pipelined or sync)"),
    "demo": ("inflight.pipeline.demo", "the CPU demo: build + warm-start a tiny model, then pipelined RL on arith"),
    "export-merged": ("inflight.trainer.lora_export", "a LoRA checkpoint (trainer.lora) merged into its base: a plain HF folder"),
    "profile": ("inflight_plan.profile_cli", "measure this machine's engine step times and trainer tokens/s for `plan`"),
    "plan": ("inflight_plan.plan_cli", "predict the best split of N devices and pipelined vs sync samples/s (simulated)"),
    "report": ("inflight.report.page", "regenerate report.html for one run, or compare several runs"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: inflight COMMAND [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`inflight COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"inflight: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, desc = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"inflight {name}", description=desc)
    module.add_arguments(parser)
    args, extra = parser.parse_known_args(rest)
    if extra and not (name == "serve" and backends.get(args.engine).launcher is not None):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # only a foreign engine takes unknown options
    args.raw_argv = rest
    from inflight.process import retain_freed_memory  # lazy: start-up cost (ctypes, subprocess): a fast `--help`

    retain_freed_memory()  # every command's process (serve, sft, the train launcher); the roles call it too
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
