"""make_weight_sync: the client `trainer.protocol` names, configured from the run config."""

import pytest

from inflight.config import RunConfig, load_config
from inflight.trainer.protocols import make_weight_sync
from inflight.trainer.protocols.sglang import SGLangWeightSync
from inflight.trainer.protocols.vllm import VLLMWeightSync
from inflight.trainer.weight_sync import WeightSyncClient

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
