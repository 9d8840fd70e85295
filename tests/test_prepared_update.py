"""An update packed as it is gathered (prepared.py) is exactly what the servers unpack: its buckets are
contracts.bucket_layout's for every bucket size, each tensor lands converted at its offset, and a lone tensor that
needed no conversion is sent as it is (never copied)."""

import pytest
import torch

from inflight.engine.weights.receiver import unpack
from inflight.trainer.weight_sync.prepared import prepare_update
from inflight.transport.layout import bucket_layout, packed_bytes
from inflight.transport.schemas import ParamInfo

SHAPES = [(3, 5), (7,), (64, 64), (1,), (0,), (33, 17), (128, 40), (2, 2), (300,)]


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).contiguous()


@pytest.mark.parametrize("bucket_bytes", [0, 64, 1000, 4096, 20000, 2**30])
def test_prepared_buckets_unpack_to_the_tensors(bucket_bytes):
    g = torch.Generator().manual_seed(bucket_bytes)
    named = [(f"t{i}", torch.randn(s, generator=g)) for i, s in enumerate(SHAPES)]
    prep = prepare_update(iter(named), to_bf16, bucket_bytes)
    assert [p["name"] for p in prep.params] == [n for n, _ in named]
    assert all(p["dtype"] == "bfloat16" and p["shape"] == list(t.shape) for p, (_, t) in zip(prep.params, named))
    assert prep.nbytes == sum(t.numel() * 2 for _, t in named)
    infos = [ParamInfo(**p) for p in prep.params]
    buckets = bucket_layout(infos, bucket_bytes)
    assert len(buckets) == len(prep.payload)
    for bucket, buf in zip(buckets, prep.payload):  # as weight_receiver._receive_all reads them
        n = packed_bytes(infos, bucket)
        assert (buf.dtype, buf.numel()) == (torch.uint8, n) if n else buf.shape == named[bucket[0][0]][1].shape
        for i, offset in bucket:
            got = unpack(buf, offset, infos[i].shape, torch.bfloat16) if n else buf
            assert torch.equal(got, named[i][1].to(torch.bfloat16)), (bucket_bytes, i)
    if bucket_bytes == 2**30:
        assert len(prep.payload) == 1
    if bucket_bytes == 0:
        assert len(prep.payload) == len(named)


def test_a_lone_tensor_in_the_wire_dtype_is_not_copied():
    big = torch.randn(64, 64).to(torch.bfloat16)
    prep = prepare_update(iter([("a", torch.ones(3, dtype=torch.bfloat16)), ("big", big)]), to_bf16, 1024)
    assert len(prep.payload) == 2 and prep.payload[1].data_ptr() == big.data_ptr()
