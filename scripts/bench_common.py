"""What the stages of the GPU bench (scripts/gpu_bench.py) share: the goals, the stage's report file, the run
config the servers and trainers are built from, the server's /metrics counters, and device timing that works on
CPU too (CUDA calls only where the device is CUDA)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# dense bf16 peak by device name (NVIDIA's data sheets): the PCIe and NVL parts run lower clocks than the SXM ones
PEAKS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989e12), ("H200", 989e12))
# key: (stage, goal, how the value meets it). goal None: a figure to report (met when it was measured)
GOALS: dict[str, tuple[str, float | None, str]] = {
    "engine_tokens_per_s_64": ("engine", 16000, ">="),
    "engine_tokens_per_s_256": ("engine", 45000, ">="),
    "engine_tokens_per_s_mixed": ("engine", 25000, ">="),
    "engine_step_ms_vs_floor_64": ("engine", None, ""),
    "engine_step_ms_vs_floor_256": ("engine", None, ""),
    "engine_pause_s": ("engine", 0.010, "<="),
    "engine_logprob_max_diff": ("engine", 0.03, "<="),
    "trainer_tokens_per_s": ("trainer", 75000, ">="),
    "trainer_mfu": ("trainer", 0.25, ">="),
    "trainer_peak_gb": ("trainer", 40.0, "<="),  # leaves the shared GPU's other 100 GB to the server
    "trainer_logprob_max_diff": ("trainer", 1e-3, "<="),
    "push_s": ("push", 0.050, "<="),
    "push_pause_s": ("push", 0.010, "<="),
    "pipelined_vs_sync_samples": ("pipeline", None, ""),
    "pipelined_vs_sync_time_to_target": ("pipeline", None, ""),
}
STAGES = ("engine", "trainer", "push", "pipeline")


# The CPU dry run (--device cpu --tiny) measures these on a 0.4M-parameter model on shared CPU cores: the same code
# paths, but not what the goal is stated in, so they are not judged (met null, with the reason). The two logprob
# checks are: float32 on CPU holds them to float rounding.
NOT_ON_CPU = {
    "engine_tokens_per_s_64": "CPU dry run: a 0.4M-parameter model, 8 streams of 32 tokens on a shared core",
    "engine_tokens_per_s_256": "CPU dry run: a 0.4M-parameter model, 32 streams of 32 tokens on a shared core",
    "engine_tokens_per_s_mixed": "CPU dry run: a 0.4M-parameter model, lengths 8-48, on a shared core",
    "engine_step_ms_vs_floor_64": "CPU dry run: host memory bandwidth and Python overhead, not a GPU's floor",
    "engine_step_ms_vs_floor_256": "CPU dry run: host memory bandwidth and Python overhead, not a GPU's floor",
    "engine_pause_s": "CPU dry run: pushes of a 1.7 MB model, not 988 MB on the GPU",
    "trainer_tokens_per_s": "CPU dry run: float32 on one CPU thread, a 1,024-token step of a 0.4M-parameter model",
    "trainer_mfu": "CPU dry run: CPU FLOP/s divided by a GPU's bf16 peak measures nothing",
    "trainer_peak_gb": "CPU dry run: the process's lifetime peak RSS (float32 reference model included), not "
                       "torch.cuda.max_memory_allocated over the two steps",
    "push_s": "CPU dry run: CPU transports (shm in /dev/shm, gloo) moving 1.7 MB, not 988 MB on the GPU",
    "push_pause_s": "CPU dry run: CPU transports (shm in /dev/shm, gloo) moving 1.7 MB, not 988 MB on the GPU",
    "pipelined_vs_sync_samples": "CPU dry run: the micro model for 4 steps, trainer and server on shared CPU cores",
    "pipelined_vs_sync_time_to_target": "CPU dry run: a target of warm-start accuracy + 0 after 4 steps",
}


def keys_of(stage: str) -> list[str]:
    return [k for k, (s, _, _) in GOALS.items() if s == stage]


def judged(key: str, value: Any, context: dict | None = None, device: str = "cuda",
           unjudged: str | None = None) -> dict[str, Any]:
    """{"value", "goal", "met"} (+ "context"): met against the goal; a figure without a goal is met once measured.
    `met` is None, with the reason, where the value cannot mean what the goal means: on CPU (NOT_ON_CPU), or
    `unjudged` (e.g. a GPU whose peak is unknown)."""
    _, goal, how = GOALS[key]
    reason = unjudged or (NOT_ON_CPU.get(key) if not device.startswith("cuda") else None)
    met: bool | None
    if value is None:
        met = False
    elif reason:
        met = None
    elif goal is None:
        met = True
    else:
        met = bool(value >= goal if how == ">=" else value <= goal)
    return {"value": value, "goal": goal, "met": met, **({"reason": reason} if reason and value is not None else {}),
            **({"context": context} if context else {})}


def bf16_peak(name: str) -> float | None:
    """Dense bf16 FLOP/s of the GPU named `name` (torch.cuda.get_device_name), None if not in PEAKS."""
    return next((peak for part, peak in PEAKS if part in name), None)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Report:
    """A stage's figures, written to OUT/stage-NAME.json at every figure, so a stage that crashes or runs out of
    time still leaves what it measured; `track` records process groups the driver kills if the stage is killed."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {"figures": {}, "pgids": [], "error": None}
        self.write()

    def figure(self, key: str, value: Any, unjudged: str | None = None, **context: Any) -> None:
        """The figure `key`; `unjudged`: why its value cannot be held to the goal here (judged() then says so)."""
        if key not in GOALS:
            raise KeyError(f"unknown figure {key!r}")
        self.data["figures"][key] = {"value": value, "context": context, **({"unjudged": unjudged} if unjudged else {})}
        log(f"{key} = {value}" + (f"   {json.dumps(context, default=str)[:400]}" if context else ""))
        self.write()

    def track(self, pgid: int) -> None:
        self.data["pgids"].append(pgid)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def run_config(a: Any, overrides: list[str] | None = None) -> Any:
    """The bench's RunConfig: --config (default the GPU config) <- the bench's one-GPU layout <- --set overrides.
    Servers and trainers are built from it as `inflight train` builds them, so options added to the config
    (server.*, trainer.*) reach the bench through their defaults or --set."""
    from inflight.config import RunConfig, load_config

    cuda = a.device.startswith("cuda")
    layout = ["server.num_servers=1", "trainer.num_processes=1", f"trainer.device={'cuda' if cuda else 'cpu'}",
              # one GPU shared by trainer and server: NCCL refuses two ranks on one device
              "trainer.weight_backend=gloo"]
    if not cuda:
        layout += ["server.dtype=float32", "trainer.precision=float32", "trainer.gradient_checkpointing=false",
                   "server.threads=1", "trainer.threads=1"]
    return load_config(RunConfig, a.config, [*layout, *(overrides or []), *a.set])


def device_sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s a device-to-device copy moves (read + written), on `device`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    device_sync(device)
    seconds = time.perf_counter() - t0
    del src, dst
    return 2 * nbytes * repeats / seconds


def peak_memory_gb(device: str) -> tuple[float, str]:
    """Peak memory of this process: CUDA allocations on CUDA, else the process's peak resident set."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak RSS of the process (CPU)"


def scrape(url: str) -> dict[str, float]:
    """The built-in server's /metrics counters, by name without the `inflight_` prefix."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^inflight_(\w+) (\S+)$", text, re.M)}


def model_shape(model_dir: str) -> dict[str, Any]:
    """Parameter count (unique tensors; the input embedding left out when the head is untied: a lookup, no
    matmul), and the shapes the FLOP and KV-byte figures need."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    card = json.loads((Path(model_dir) / "smoke.json").read_text())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    embed = cfg.vocab_size * cfg.hidden_size
    return {"parameters": card["parameters"], "tied": bool(cfg.tie_word_embeddings),
            "matmul_parameters": card["parameters"] - (0 if cfg.tie_word_embeddings else embed),
            "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim, "vocab": cfg.vocab_size}
