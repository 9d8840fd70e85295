"""trainer.weight_transport=cuda_ipc is accepted only where the trainer's buffer can be shared: built-in servers
the local launcher starts on the trainer's own GPU (or, with a CPU trainer, on the CPU: the stand-in)."""

from __future__ import annotations

import pytest

from inflight.config import RunConfig, load_config
from inflight.pipeline.launch_common import check_config
from inflight.pipeline.transport_check import check_weight_transport


def cfg(*overrides: str):
    return load_config(RunConfig, None, ["model.path=/m", "pipeline.max_steps=1", "trainer.weight_transport=cuda_ipc",
                                         *overrides])


ONE_GPU = ["trainer.device=cuda", "pipeline.trainer_devices='0'", "pipeline.server_devices=['0']",
           "server.num_servers=1"]


@pytest.mark.parametrize("overrides", [
    ONE_GPU,
    ["trainer.device=cuda", "pipeline.trainer_devices='1'", "pipeline.server_devices=['1','1']",
     "server.num_servers=2"],
    ["trainer.device=cpu"],  # servers on the CPU: the shared-memory stand-in
])
def test_cuda_ipc_where_trainer_and_servers_share_a_device(overrides):
    check_weight_transport(cfg(*overrides))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.device=cuda", "pipeline.trainer_devices='0'", "pipeline.server_devices=['1']",
      "server.num_servers=1"], "server 0 on '1'; use trainer.weight_transport=process_group (NCCL)"),
    (["trainer.device=cuda", "pipeline.trainer_devices='0'", "pipeline.server_devices=['0','1']",
      "server.num_servers=2"], "server 1 on '1'"),
    (["trainer.device=cuda", "pipeline.server_devices=['0']", "server.num_servers=1"],
     "set pipeline.trainer_devices to one GPU"),
    (["trainer.device=cuda", "pipeline.trainer_devices='0,1'", "pipeline.server_devices=['0']",
      "server.num_servers=1"], "set pipeline.trainer_devices to one GPU"),
    (["trainer.device=cuda:1", "pipeline.trainer_devices='0'", "pipeline.server_devices=['0']"],
     "trainer.device=cuda"),
    ([*ONE_GPU, "server.engine=vllm"], "needs the built-in engine"),
    ([*ONE_GPU, "trainer.protocol=sglang"], "needs the built-in engine"),
    ([*ONE_GPU, "pipeline.server_urls=['http://127.0.0.1:8000']"], "servers the local launcher starts"),
    (["trainer.device=cpu", "pipeline.server_devices=['0']", "server.num_servers=1"], "servers on GPUs"),
    (["trainer.weight_transport=auto"], "must be one of process_group, shm, file, cuda_ipc"),
])
def test_cuda_ipc_is_refused_with_the_reason(overrides, message):
    with pytest.raises(ValueError) as e:
        check_weight_transport(cfg(*overrides))
    assert message in str(e.value)


def test_check_config_runs_the_transport_check(tmp_path):
    c = load_config(RunConfig, None, [f"model.path={tmp_path}", "pipeline.max_steps=1",
                                      "trainer.weight_transport=cuda_ipc", "server.engine=sglang"])
    with pytest.raises(ValueError, match="needs the built-in engine"):
        check_config(c)
