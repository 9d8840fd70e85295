from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    engine: str = "builtin"  # a backend's name: builtin, vllm, sglang or a registered one (inflight/backends.py)
    num_servers: int = 1
    host: str = "127.0.0.1"
    base_port: int = 8100  # server k listens on base_port + k
    dtype: str = "float32"  # float32 | bfloat16
    # int8 quantizes activations with one scale per batch: far off on real checkpoints (SmolLM2-135M: KL 0.72 per
    # token against float32), so check a model with bench/precision.py first
    generator_precision: str = "float32"  # float32 | bfloat16 | bfloat16-fp32-head | int8 (built-in engine)
    max_batch: int = 128  # sequences decoded together
    max_model_len: int = 512
    max_tokens_per_step: int = 4096  # token budget of one engine step (prefill chunks + decodes)
    low_priority_prefill: int = 256  # built-in engine: prefill tokens per step for evaluation (priority > 0) requests
    low_priority_seqs: int = 0  # built-in engine: evaluation sequences running at once (0: no limit)
    prefix_reuse: bool = True  # built-in engine: finished sequences' KV reused by prompts that continue them
    cuda_graphs: str = "auto"  # auto | on | off: built-in engine's decode steps as CUDA graphs (auto: on for CUDA)
    api_key: str = ""
    threads: int = 0  # torch threads per server (0 = torch's default; OMP_NUM_THREADS for vllm/sglang)
    python: str = ""  # interpreter that starts the servers: vLLM's / SGLang's environment (empty = the trainer's)
    # ChatML with a Hermes tools section (chatml_tools) is shipped for ChatML models without one, such as SmolLM2
    chat_template: str = ""  # builtin / vllm: a Jinja file or shipped template replacing the model's (actor too)
    tool_call_parser: str = "auto"  # auto | none | hermes: reads tool calls out of chat replies (auto: the template's)
    extra_args: list[str] = field(default_factory=list)  # appended to each server's command line (last wins)

    def __post_init__(self) -> None:
        # YAML reads a bare on / off as a boolean, which reaches a str field as "True" / "False"
        self.cuda_graphs = {"true": "on", "false": "off"}.get(str(self.cuda_graphs).lower(), self.cuda_graphs)
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"server.cuda_graphs must be auto, on or off, not {self.cuda_graphs!r}")
        if self.low_priority_prefill < 1 or self.low_priority_seqs < 0:
            raise ValueError("server.low_priority_prefill must be >= 1 and server.low_priority_seqs >= 0 (0: no limit), "
                             f"not {self.low_priority_prefill} and {self.low_priority_seqs}")
        if self.tool_call_parser not in ("auto", "none", "hermes"):
            raise ValueError(f"server.tool_call_parser must be auto, none or hermes, not {self.tool_call_parser!r}")
        if self.chat_template and self.engine not in ("builtin", "vllm"):  # SGLang renders prompts itself
            raise ValueError(f"server.chat_template is for engines builtin and vllm; with engine {self.engine!r}, give the "
                             "engine's own chat-template option in server.extra_args")
