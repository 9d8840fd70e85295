"""msgpack serialisation of groups: exact round trip, clear errors on bad input, no pickle."""

from __future__ import annotations

import math
import pickle

import msgpack
import pytest
from hypothesis import given, settings, strategies as st
from streamdata import bits, make_group, same_group

from inflight.contracts import Sample
from inflight.streams.serialize import SerializationError, decode_group, encode_group


def test_round_trip_is_exact():
    for i in range(20):
        g = make_group(i, group_size=4)
        back = decode_group(encode_group(g))
        assert same_group(g, back)
        assert back[0].label == "correct" and isinstance(back[0].label, str)  # Verdict travels as its value
        assert all(type(v) is int for v in back[0].prompt_ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), max_size=40))
def test_logprobs_bit_exact(lps):
    s = Sample(group_id="g", prompt_ids=[1], completion_ids=list(range(len(lps))), logprobs=lps,
               versions=[0] * len(lps))
    back = decode_group(encode_group([s]))[0]
    assert bits(back.logprobs) == bits(lps)  # -0.0, NaN payloads, subnormals included


def test_float32_values_survive_exactly():
    import array
    f32 = array.array("f", [-0.1, -3.3333333, -1e-30]).tolist()  # float32 values widened to double
    s = Sample(group_id="g", prompt_ids=[1], completion_ids=[1, 2, 3], logprobs=f32, versions=[0, 0, 1])
    assert decode_group(encode_group([s]))[0].logprobs == f32
    assert not math.isclose(f32[0], -0.1, rel_tol=0, abs_tol=0)  # the test really uses float32 values


def test_bad_meta_is_a_clear_error():
    s = Sample(group_id="g", prompt_ids=[1], completion_ids=[], logprobs=[], versions=[], meta={"s": {1, 2}})
    with pytest.raises(SerializationError, match="meta"):
        encode_group([s])


@pytest.mark.parametrize("blob", [
    b"", b"\xc1", pickle.dumps(make_group(0)), msgpack.packb([99, []]), msgpack.packb([1, [{"g": "x"}]]),
    msgpack.packb([1, [{"g": 1, "p": b"", "c": b"", "l": b"", "v": b"", "r": 0.0, "lb": "", "f": "", "t": "",
                        "m": {}}]]),
    msgpack.packb([1, [{"g": "x", "p": b"abc", "c": b"", "l": b"", "v": b"", "r": 0.0, "lb": "", "f": "", "t": "",
                        "m": {}}]]),  # 3 bytes is not a whole int64
])
def test_malformed_bytes_rejected(blob):
    with pytest.raises(SerializationError):
        decode_group(blob)


def test_loss_mask_round_trips_and_is_checked():
    s = Sample(group_id="g", prompt_ids=[1], completion_ids=[2, 3, 4], logprobs=[-1.0, 0.0, -2.0],
               versions=[0, -1, 1], loss_mask=[1, 0, 1])
    (back,) = decode_group(encode_group([s]))
    assert back.loss_mask == [1, 0, 1] and back.versions == [0, -1, 1]
    (plain,) = decode_group(encode_group([Sample("g", [1], [2], [-1.0], [0])]))
    assert plain.loss_mask is None
    fmt, (d,) = msgpack.unpackb(encode_group([s]), raw=False)
    for bad in (bytes([1, 7, 1]), [1, 0, 1]):
        with pytest.raises(SerializationError, match="loss mask"):
            decode_group(msgpack.packb([fmt, [{**d, "k": bad}]], use_bin_type=True))
