"""One rank of the FSDP2 push-retry test (a subprocess with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set).

usage: python fsdp_push_worker.py MODEL_DIR RUN_DIR OUT_FILE SERVER_URL SERVER_PID
Both ranks shard the model and move its weights. Rank 0 forms the weight group with the server, then restarts it
(SIGKILL, a new `inflight serve` on the same port: in no group, it answers the next update with 409). Both ranks
then push through DistributedTrainerLoop's own path; rank 0 saves the weights (gathered again afterwards), the
server's version and a sampled reply with logprobs, and how many gathers each push took on each rank.
"""

import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inflight.config import RunConfig  # noqa: E402
from inflight.config.trainer import TrainerConfig  # noqa: E402
from inflight.engine.serve import ServerProcess  # noqa: E402
from inflight.report.metrics import MetricsLogger  # noqa: E402
from inflight.trainer.fsdp import FSDP2Trainer  # noqa: E402
from inflight.trainer.loop.fsdp_loop import DistributedTrainerLoop  # noqa: E402
from inflight.trainer.weight_sync.inflight import WeightSyncClient  # noqa: E402
from inflight.trainer.weight_sync.rejoin import refused  # noqa: E402
from tests.reliability.test_weight_update_faults import SERVE  # noqa: E402
from tests.test_lora_push import chat  # noqa: E402
from tests.trainer.cpu_collectives import default_group_refuses_cpu_tensors  # noqa: E402


def main(model_dir: str, run_dir: str, out: str, url: str, pid: int) -> None:
    default_group_refuses_cpu_tensors()  # as NCCL would on CUDA
    t = FSDP2Trainer(model_dir, TrainerConfig(backend="fsdp2", threads=1))
    t.init()
    rank = t.rank
    torch.manual_seed(rank)
    with torch.no_grad():  # new weights on every shard, so that an applied update shows in the server's outputs
        for p in t.model.parameters():
            p.to_local().add_(0.05 * torch.randn_like(p.to_local()))
    gathers = []
    real = t.named_weights
    t.named_weights = lambda *a, **k: (gathers.append(1), real(*a, **k))[1]
    cfg = RunConfig()
    cfg.pipeline.weight_sync_retries, cfg.pipeline.startup_timeout_s = 2, 60.0
    sync, restarted = None, None
    if rank == 0:
        sync = WeightSyncClient([url], timeout_s=60.0, bucket_bytes=4096)  # small buckets: packed and lone tensors
        sync.init_process_group()
        os.kill(pid, signal.SIGKILL)
        while not refused(url):
            time.sleep(0.1)
        restarted = ServerProcess(model_dir, port=int(url.rsplit(":", 1)[1]), extra_args=SERVE)
    try:
        loop = DistributedTrainerLoop(cfg, t, None, sync, MetricsLogger(run_dir, "trainer") if rank == 0 else None,
                                      run_dir, rank=rank, world_size=t.world_size)
        loop._send_weights(1)
        at_push = len(gathers)
        weights = {n: w.clone() for n, w in real()}  # collective
        if rank == 0:
            import httpx

            health = httpx.get(url + "/health", timeout=10).json()
            torch.save({"weights": weights, "version": health["version"], "choice": chat(url)}, out)
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"gathers_at_push": at_push}, f)
    finally:
        if restarted is not None:
            restarted.stop()
        if sync is not None:
            sync.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
