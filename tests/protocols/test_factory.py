"""make_weight_sync: the client `trainer.protocol` names, configured from the run config."""

import pytest

from inflight.config import RunConfig, load_config
from inflight.trainer.weight_sync import make_weight_sync
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from inflight.trainer.weight_sync.sglang import SGLangWeightSync
from inflight.trainer.weight_sync.vllm import VLLMWeightSync

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2/"]


@pytest.mark.parametrize("protocol,cls", [("inflight", WeightSyncClient), ("vllm", VLLMWeightSync),
                                          ("sglang", SGLangWeightSync)])
def test_each_protocol(protocol, cls):
    cfg = load_config(RunConfig, overrides=[f"trainer.protocol={protocol}", "pipeline.weight_sync_port=29123"])
    client = make_weight_sync(cfg, URLS)
    try:
        assert type(client) is cls
        assert client.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and client.world_size == 3
        assert client.master_port == 29123
        for m in ("init_process_group", "push", "close"):
            assert callable(getattr(client, m))
    finally:
        client.close()


def test_bad_settings():
    cfg = load_config(RunConfig, overrides=["trainer.protocol=tgi"])
    with pytest.raises(ValueError, match="unknown trainer.protocol 'tgi'"):
        make_weight_sync(cfg, URLS)
    cfg = load_config(RunConfig, overrides=["trainer.protocol=sglang", "trainer.weight_transport=file"])
    with pytest.raises(ValueError, match="process group only"):
        make_weight_sync(cfg, URLS)


@pytest.mark.parametrize("device,choice,want", [("cpu", "auto", "gloo"), ("cuda", "auto", "nccl"),
                                                ("cuda:1", "gloo", "gloo"), ("cuda", "nccl", "nccl")])
def test_weight_backend(device, choice, want):
    """trainer.weight_backend: a CUDA trainer is not forced onto NCCL (one GPU shared with a server needs gloo)."""
    from inflight.trainer.weight_sync import weight_backend

    assert weight_backend(choice, device) == want


def test_weight_backend_and_transport_reach_the_client():
    cfg = load_config(RunConfig, overrides=["trainer.weight_backend=gloo", "trainer.weight_transport=shm",
                                            "trainer.shm_dir=/tmp"])
    client = make_weight_sync(cfg, URLS)
    try:
        assert (client.backend, client.transport, client.shm_dir) == ("gloo", "shm", "/tmp")
        assert client.device is None  # a CPU trainer binds no device on the helper threads
    finally:
        client.close()
    for bad, match in ((["trainer.weight_backend=mpi"], "auto, nccl or gloo"),
                       (["trainer.weight_backend=nccl"], "needs a CUDA trainer"),
                       (["trainer.weight_transport=tcp"], "transport must be one of process_group, file, shm"),
                       (["trainer.protocol=vllm", "trainer.weight_backend=gloo"], "vLLM's own NCCL")):
        with pytest.raises(ValueError, match=match):
            make_weight_sync(load_config(RunConfig, overrides=bad), URLS)


def test_the_communicator_is_built_on_the_trainers_device(monkeypatch):
    """vLLM's trainer_init takes torch.accelerator.current_device_index(), and it runs on a helper thread, which
    starts on device 0: the thread makes trainer.device current first (recorded through torch.cuda.set_device)."""
    import threading

    import torch

    from inflight.trainer.weight_sync.common import Broadcaster

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", str(d))))

    def sender(address, port, world_size, store):
        events.append(("sender", threading.current_thread().name))
        return Broadcaster()

    client = VLLMWeightSync(URLS, make_sender=sender, device="cuda:2", timeout_s=5)
    try:
        client.host_group(lambda: [], lambda store: client.make_sender("127.0.0.1", 1, 3, store), host_store=False)
    finally:
        client.close()
    assert events == [("set_device", "cuda:2"), ("sender", "weight-group")]


def test_lora_with_stock_server_protocols(tmp_path):
    """trainer.lora: SGLang refused; vLLM takes adapters through its runtime LoRA loading (vllm_lora.py), in keep
    mode and with actor.adapter=vllm only, checked at config time, before anything starts."""
    from inflight.pipeline.launch_common import check_lora_run
    from inflight.trainer.weight_sync.vllm_lora import VLLMLoraSync

    cfg = load_config(RunConfig, overrides=["trainer.protocol=sglang", "trainer.lora.rank=8"])
    for fn in (check_lora_run, lambda c: make_weight_sync(c, URLS)):
        with pytest.raises(ValueError, match="trainer.protocol=sglang is not supported"):
            fn(cfg)
    ok = ["trainer.protocol=vllm", "trainer.lora.rank=8", "actor.adapter=vllm", "actor.max_lag=2",
          f"pipeline.run_dir={tmp_path}", "name=r"]
    for bad, match in ((["pipeline.update_mode=interrupt"], "update_mode must be 'keep'"),
                       (["actor.adapter=builtin"], "needs actor.adapter=vllm")):
        cfg = load_config(RunConfig, overrides=ok + bad)
        with pytest.raises(ValueError, match=match):
            check_lora_run(cfg)
        with pytest.raises(ValueError, match=match):
            make_weight_sync(cfg, URLS)
    cfg = load_config(RunConfig, overrides=ok)
    check_lora_run(cfg)
    client = make_weight_sync(cfg, URLS)
    try:
        assert type(client) is VLLMLoraSync and client.world_size == 1
        assert client.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        assert client.folder == tmp_path / "r" / "served_adapters" and client.keep == 4  # max_lag + 2
        assert client.name == "inflight-lora"
    finally:
        client.close()
    check_lora_run(load_config(RunConfig, overrides=["trainer.lora.rank=8"]))  # inflight's protocol carries them
