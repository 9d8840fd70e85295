"""The `server:` section. `EngineSettings` declares the built-in engine's settings once: each field's default, help
text and allowed values, checked once (`__post_init__`). Every form a setting takes is generated from it: the YAML
key `server.X`, the `inflight serve --X` option (`add_flags`), the launcher's command line (`to_argv`), the object
the server parses back (`from_args`) and docs/configuration.md. `InferenceEngine` (engine/core.py) and the app
(engine/api/server.py) take the object. `ServerConfig` adds what a run needs to start its servers.
"""

import argparse
import os
from dataclasses import Field, dataclass, field, fields
from typing import Any, Iterable

DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("float32", "bfloat16", "bfloat16-fp32-head", "int8")  # engine/model/precision.py
CUDA_GRAPHS = ("auto", "on", "off")
TOOL_CALL_PARSERS = ("auto", "none", "hermes")  # auto, none and engine/api/tool_parser.py's PARSERS


def setting(default: Any, help: str, choices: tuple[str, ...] = (), env: str = "") -> Any:
    """An EngineSettings field: `help` is its text in `inflight serve --help` and docs/configuration.md, `choices`
    the values it takes (none: any of its type), `env` an environment variable that gives the option's default."""
    return field(default=default, metadata={"help": help, "choices": choices, "env": env})


@dataclass
class EngineSettings:
    """The built-in engine's and its HTTP server's settings: `server.X` in YAML, `--X` for `inflight serve`."""

    # the engine (engine/core.py)
    dtype: str = setting("float32", "the weights' dtype, the one weight updates arrive in", DTYPES)
    generator_precision: str = setting(
        "float32", "built-in engine: what the forward computes with; updates still arrive in dtype "
        "(engine/model/precision.py). int8 quantizes activations with one scale per batch: far off on real "
        "checkpoints (SmolLM2-135M: KL 0.72 per token against float32), so check a model with bench/precision.py "
        "first", PRECISIONS)
    max_batch: int = setting(128, "sequences decoded together")
    max_model_len: int = setting(512, "context length (prompt + completion)")
    max_tokens_per_step: int = setting(4096, "token budget of one engine step (prefill chunks + decodes)")
    low_priority_prefill: int = setting(
        256, "built-in engine: prefill tokens per step for requests of priority > 0 (held-out evaluation), so they "
        "never make a long step that rollouts and weight updates wait for")
    low_priority_seqs: int = setting(
        0, "built-in engine: sequences of priority > 0 running at once (0: no limit), so evaluation decodes do not "
        "lengthen every step that rollouts and weight updates wait for")
    prefix_reuse: bool = setting(
        True, "built-in engine: keep finished sequences' KV in free slots; a prompt that continues one (a multi-turn "
        "episode's next turn) prefills only the rest (engine/scheduler/prefix_cache.py)")
    cuda_graphs: str = setting(
        "auto", "built-in engine: decode steps replayed as CUDA graphs, one per batch bucket (auto: on a CUDA device; "
        "on: also on CPU, run eagerly, for checks; docs/backends.md)", CUDA_GRAPHS)
    threads: int = setting(0, "torch threads per server (0: torch's default; vllm / sglang: OMP_NUM_THREADS)")
    chat_template: str = setting(
        "", "builtin and vllm: render chat messages with this template instead of the model's (the actor's too): a "
        "Jinja file, or a shipped one by name (chatml_tools: ChatML with a Hermes tools section, for ChatML models "
        "without one such as SmolLM2; docs/inference-contract.md)")
    tool_call_parser: str = setting(
        "auto", "builtin and vllm: read tool calls out of chat replies when a request has tools (auto: hermes when "
        "the chat template writes <tool_call>, else none)", TOOL_CALL_PARSERS)
    # the HTTP server (engine/api/server.py; the vLLM launcher takes some: SETTINGS in engine/vllm_backend/launcher.py)
    api_key: str = setting("", "require 'Authorization: Bearer KEY' on every endpoint but /health",
                           env="INFLIGHT_API_KEY")
    allow_remote_admin: bool = setting(
        False, "builtin and vllm: accept /init_process_group and /request_weight_update from non-local clients")
    max_waiting: int = setting(
        -1, "built-in server: sequences that may wait beyond max_batch; more get HTTP 429 (-1: no limit)")
    max_body_bytes: int = setting(8 * 2**20, "built-in server: larger request bodies get HTTP 413")
    header_timeout_s: float = setting(
        10.0, "builtin and vllm: a connection whose request headers are not complete in this time is closed")
    body_timeout_s: float = setting(
        30.0, "builtin and vllm: a request body not received in this time gets HTTP 408 and its connection closed")
    reject_nonfinite: bool = setting(
        True, "built-in server: refuse weight updates holding NaN/Inf (checked after receiving, before applying)")
    version_wait_s: float = setting(
        300.0, "built-in server: a request whose min_weight_version is not reached in this time gets HTTP 409")

    def __post_init__(self) -> None:
        # YAML reads a bare on / off as a boolean, which reaches a str field as "True" / "False"
        self.cuda_graphs = {"true": "on", "false": "off"}.get(str(self.cuda_graphs).lower(), self.cuda_graphs)
        for f in fields(EngineSettings):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices and value not in choices:
                raise ValueError(f"server.{f.name} must be one of {', '.join(choices[:-1])} or {choices[-1]}, "
                                 f"not {value!r}")
        if self.low_priority_prefill < 1 or self.low_priority_seqs < 0:
            raise ValueError("server.low_priority_prefill must be >= 1 and server.low_priority_seqs >= 0 (0: no limit), "
                             f"not {self.low_priority_prefill} and {self.low_priority_seqs}")


def flag(name: str) -> str:
    """A setting's command-line option: `--` and the field's name with dashes."""
    return "--" + name.replace("_", "-")


def _fields(names: Iterable[str] | None) -> list[Field]:
    every = {f.name: f for f in fields(EngineSettings)}
    return list(every.values()) if names is None else [every[n] for n in names]


def add_flags(p: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """The settings (all, or those in `names`) as options of `p`, each from its field: type, default, choices and
    help; a bool as `--x` / `--no-x`."""
    for f in _fields(names):
        env = f.metadata["env"]
        default = (os.environ.get(env) if env else None) or f.default
        text = f.metadata["help"].replace("%", "%%") + (" (default: %(default)s)" if f.default != "" else "")
        text += f" (env {env})" if env else ""
        if isinstance(f.default, bool):
            p.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            p.add_argument(flag(f.name), type=type(f.default), default=default, choices=f.metadata["choices"] or None,
                           help=text)


def to_argv(s: EngineSettings, names: Iterable[str] | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """The options that give a parser of `add_flags` the settings of `s`: those (all, or those in `names`, less
    `skip`) whose value is not the default."""
    out: list[str] = []
    for f in _fields(names):
        value = getattr(s, f.name)
        if f.name in skip or value == f.default:
            continue
        if isinstance(f.default, bool):
            out.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        else:
            out += [flag(f.name), str(value)]
    return out


def from_args(args: argparse.Namespace, names: Iterable[str] | None = None) -> EngineSettings:
    """The settings a parser of `add_flags` read (those not in `names` keep their default), checked as YAML is."""
    return EngineSettings(**{f.name: getattr(args, f.name) for f in _fields(names)})


@dataclass
class ServerConfig(EngineSettings):
    """The `server:` section: the engine's settings (above) and how a run starts its servers."""

    engine: str = "builtin"  # a backend's name: builtin, vllm, sglang or a registered one (inflight/backends.py)
    num_servers: int = 1
    host: str = "127.0.0.1"
    base_port: int = 8100  # server k listens on base_port + k
    python: str = ""  # interpreter that starts the servers: vLLM's / SGLang's environment (empty = the trainer's)
    extra_args: list[str] = field(default_factory=list)  # appended to each server's command line (last wins)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chat_template and self.engine not in ("builtin", "vllm"):  # SGLang renders prompts itself
            raise ValueError(f"server.chat_template is for engines builtin and vllm; with engine {self.engine!r}, give the "
                             "engine's own chat-template option in server.extra_args")
