from dataclasses import dataclass, field


@dataclass
class PipelineConfig:
    mode: str = "pipelined"  # pipelined | sync
    update_mode: str = "keep"  # keep (PipelineRL) | interrupt (AReaL)
    num_grad_steps: int = 4  # sync mode: optimizer steps per generation round
    max_steps: int = 100
    max_samples: int = 0  # 0 = no limit
    max_minutes: float = 0.0  # 0 = no limit
    run_dir: str = "runs"  # the run writes to <run_dir>/<name>/
    stream: str = "memory"  # memory | redis
    redis_url: str = "redis://127.0.0.1:6379/0"
    checkpoint_every: int = 0  # trainer steps between checkpoints (0 = only the final one)
    keep_checkpoints: int = 2  # step checkpoints kept (the newest); "final" is kept as well
    restart_servers: bool = False  # restart a dead built-in server (it gets the current weights before requests)
    weight_sync_retries: int = 3  # failed weight updates retried (weight group formed again) before the trainer stops
    tensorboard: bool = True
    wandb: bool = False  # W&B in offline mode (needs the wandb package)
    # where the roles run (a multi-host launcher fills these in; the roles read nothing else)
    server_urls: list[str] = field(default_factory=list)  # use running servers instead of launching them
    server_devices: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES of server k (empty = inherit)
    trainer_devices: str = ""  # CUDA_VISIBLE_DEVICES of the trainer (empty = inherit)
    weight_sync_host: str = "127.0.0.1"  # trainer rank 0's address, as the servers see it
    weight_sync_port: int = 29555  # TCPStore port of the weight-update process group
    # launcher
    launcher: str = "local"  # local (one host, processes) | ray (the hosts of a Ray cluster, docs/multi-host.md)
    ray_address: str = ""  # Ray cluster: host:port, "auto" (the one `ray start` began here); empty: a new one
    ray_resources: dict[str, str] = field(default_factory=dict)  # role -> Ray resource that pins it to hosts
    startup_timeout_s: float = 0.0  # /health, Ray placement; 0: 180 s builtin, vLLM/SGLang 600 s + 60/server
    scrape_every_s: float = 2.0  # how often the launcher reads each server's /metrics
    progress: bool = True  # live progress line in the terminal
    warn_truncated_frac: float = 0.5  # warn (log + "warning" event) when more than this share is cut off by the limit
    warn_truncated_steps: int = 20  # ... for this many steps in a row (0 = never)
    log_tail_lines: int = 15  # lines of a failed role's log printed on failure

