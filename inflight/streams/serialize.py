"""Groups of samples <-> bytes, with msgpack (never pickle: stream bytes may come over the network).

Numeric lists travel as little-endian binary arrays: token ids and versions as int64, logprobs as float64 (a loss
mask, when the sample has one, as bytes of 0/1; no key when it has none), so a
Python float (a C double) round-trips bit-exactly and decoding is one memcpy instead of a per-element parse.
`meta` must hold msgpack types only (None, bool, int, float, str, bytes, list, dict with str keys).
"""

from __future__ import annotations

import sys
from array import array
from enum import Enum
from typing import Any

import msgpack

from inflight.contracts import Group, Sample

FORMAT = 1  # bump when the layout below changes
_LITTLE = sys.byteorder == "little"


class SerializationError(ValueError):
    """Bytes that are not a group of this format, or a sample that cannot be encoded."""


def _pack_array(typecode: str, values: list[Any]) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpack_array(typecode: str, data: bytes) -> list[Any]:
    a = array(typecode)
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def _sample_to_dict(s: Sample) -> dict[str, Any]:
    return {
        "g": s.group_id,
        "p": _pack_array("q", s.prompt_ids),
        "c": _pack_array("q", s.completion_ids),
        "l": _pack_array("d", s.logprobs),
        "v": _pack_array("q", s.versions),
        "r": float(s.reward),
        "lb": s.label.value if isinstance(s.label, Enum) else s.label,  # a Verdict travels as its value
        "f": s.finish_reason,
        "t": s.task_id,
        "m": s.meta,
        **({} if s.loss_mask is None else {"k": bytes(1 if m else 0 for m in s.loss_mask)}),
    }


_TEXT_KEYS = ("g", "lb", "f", "t")


def _sample_from_dict(d: dict[str, Any]) -> Sample:
    if not isinstance(d, dict) or any(not isinstance(d[k], str) for k in _TEXT_KEYS):
        raise SerializationError("a sample must be a map with text fields g, lb, f, t")
    if not isinstance(d["r"], float) or not isinstance(d["m"], dict):
        raise SerializationError("a sample's reward must be a float and its meta a map")
    mask = d.get("k")
    if mask is not None and (not isinstance(mask, bytes) or any(b > 1 for b in mask)):
        raise SerializationError("a sample's loss mask must be bytes of 0 and 1")
    return Sample(
        group_id=d["g"],
        prompt_ids=_unpack_array("q", d["p"]),
        completion_ids=_unpack_array("q", d["c"]),
        logprobs=_unpack_array("d", d["l"]),
        versions=_unpack_array("q", d["v"]),
        reward=d["r"],
        label=d["lb"],
        finish_reason=d["f"],
        task_id=d["t"],
        meta=d["m"],
        loss_mask=None if mask is None else list(mask),
    )


def encode_group(group: Group) -> bytes:
    """One group (the G samples of a prompt) -> bytes."""
    try:
        return msgpack.packb([FORMAT, [_sample_to_dict(s) for s in group]], use_bin_type=True)
    except (TypeError, OverflowError, ValueError) as exc:
        raise SerializationError(f"cannot encode group: {exc} (meta must hold msgpack types only)") from exc


def decode_group(data: bytes) -> Group:
    """bytes -> one group; anything malformed raises SerializationError (never executes code)."""
    try:
        fmt, samples = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if fmt != FORMAT:
            raise SerializationError(f"group format {fmt!r}, this code reads format {FORMAT}")
        return [_sample_from_dict(d) for d in samples]
    except SerializationError:
        raise
    except Exception as exc:  # msgpack errors, wrong shapes, missing keys, odd-length arrays
        raise SerializationError(f"not a serialised group: {type(exc).__name__}: {exc}") from exc


def encode_groups(groups: list[Group]) -> list[bytes]:
    return [encode_group(g) for g in groups]


def decode_groups(blobs: list[bytes]) -> list[Group]:
    return [decode_group(b) for b in blobs]
