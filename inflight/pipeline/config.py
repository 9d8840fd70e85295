from dataclasses import dataclass


@dataclass
class PipelineConfig:
    mode: str = "pipelined"  # pipelined | sync
    update_mode: str = "keep"  # keep (PipelineRL) | interrupt (AReaL)
    num_grad_steps: int = 4  # sync mode: optimizer steps per generation round
    max_steps: int = 100
    max_samples: int = 0  # 0 = no limit
    max_minutes: float = 0.0  # 0 = no limit
    run_dir: str = "runs"
    stream: str = "memory"  # memory | redis
    redis_url: str = "redis://127.0.0.1:6379/0"
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    tensorboard: bool = True
    wandb: bool = False
