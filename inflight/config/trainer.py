from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    """Train a LoRA adapter (PEFT) instead of the full model: the base stays frozen, the optimizer holds only the
    adapter, and each push sends only the adapter's A/B matrices (docs/inference-contract.md, "Adapter updates")."""

    rank: int = 8  # the adapter's rank r: A is [r, in], B is [out, r] per adapted linear layer
    alpha: float = 16.0  # scaling = alpha / rank (alpha / sqrt(rank) with rslora)
    dropout: float = 0.0  # on the adapter's input in training (RL: keep 0, the behaviour logprobs have none)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # PEFT's names; all-linear: not lm_head
    rslora: bool = False  # PEFT's rank-stabilised scaling alpha / sqrt(rank)
    # trainer.protocol=vllm (stock vLLM, --enable-lora): version N is loaded as "<served_name>-vN" from a PEFT folder
    # under served_dir, which the servers must read at the same path (empty: <run dir>/served_adapters)
    served_name: str = "inflight-lora"
    served_dir: str = ""


@dataclass
class TrainerConfig:
    backend: str = "single"  # single | fsdp2 (every algo.loss, KL and entropy term on both)
    num_processes: int = 1  # ranks for fsdp2 (actor.groups_per_step must be a multiple of it)
    fsdp_shard_one_rank: bool = False  # fsdp2 at one rank: shard anyway (false: the plain module, nothing to shard)
    device: str = "cpu"
    precision: str = "float32"  # float32 | bf16-mixed (GPU)
    gradient_checkpointing: bool | str = False  # true | false | auto (on only when the step would not fit the device)
    chunked_head: bool = True  # logprobs from the hidden states a chunk of tokens at a time (no [tokens, vocab] logits)
    attention: str = "auto"  # auto | inflight_varlen (GPU) | inflight_packed (CPU) | sdpa | eager | flash_attention_2
    fused_optimizer: bool = True  # torch's fused AdamW kernel where it runs (CUDA; plain CPU tensors)
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    total_steps: int = 1000  # for the cosine schedule
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096  # sequence-packing token budget of one micro-batch
    threads: int = 0  # torch threads (0 = torch's default)
    weight_transport: str = "process_group"  # process_group (any hosts) | shm | file (trainer and servers on one host) | cuda_ipc (servers on the trainer's device)
    weight_backend: str = "auto"  # process_group: nccl | gloo | auto (nccl on a CUDA trainer, else gloo)
    weight_bucket_mb: float = 16.0  # process_group: small tensors packed into one broadcast per bucket (0 = per tensor)
    shm_dir: str = "/dev/shm"  # shm and file transports: a memory file system all servers of the host can read
    protocol: str = "inflight"  # weight-update protocol of the servers: inflight, vllm, sglang (inflight/backends.py)
    lora: LoraConfig | None = None  # null: full fine-tuning; set (e.g. trainer.lora.rank=8): a LoRA adapter
