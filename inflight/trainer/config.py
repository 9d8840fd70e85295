from dataclasses import dataclass


@dataclass
class TrainerConfig:
    backend: str = "single"  # single | fsdp2
    num_processes: int = 1  # ranks for fsdp2
    device: str = "cpu"
    precision: str = "float32"  # float32 | bf16-mixed (GPU)
    gradient_checkpointing: bool = False
    attention: str = "auto"  # auto | inflight_packed (per-sample SDPA) | sdpa (4D mask) | eager | flash_attention_2
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    total_steps: int = 1000  # for the cosine schedule
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096  # sequence-packing token budget of one micro-batch
    threads: int = 0  # torch threads (0 = torch's default)
    weight_transport: str = "process_group"  # process_group (any hosts) | shm | file (trainer and servers on one host)
    weight_backend: str = "auto"  # process_group: nccl | gloo | auto (nccl on a CUDA trainer, else gloo)
    weight_bucket_mb: float = 16.0  # process_group: small tensors packed into one broadcast per bucket (0 = per tensor)
    shm_dir: str = "/dev/shm"  # shm and file transports: a memory file system all servers of the host can read
    protocol: str = "inflight"  # inflight | vllm | sglang (weight-update protocol of the servers)
