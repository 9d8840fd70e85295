"""The checks every weight-update transport shares (docs/inference-contract.md, "Weight updates"), used by the
built-in engine's `WeightReceiver` and the vLLM backend's `VLLMWeightReceiver`: the announcement against the model
(names, shapes, dtypes; adapter pairs), the version rule, a safetensors file's header, a shared-memory segment's
header, and the NaN/Inf check.

Refusals that name a path the client chose say one thing whatever went wrong (missing, unreadable, not a regular
file, another size, not the right format): the reason goes to the server's log only, so an admin request cannot
probe which files exist on the server's host, or how large they are.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from inflight.transport.schemas import AdapterSpec, ParamInfo, LORA_SUFFIXES, adapter_pairs

from inflight.transport.layout import shm_layout
from inflight.transport.finite import nonfinite
from inflight.transport.shm import ShmError, UnreadableSegment, announcement_digest, check_segment, wait_complete

log = logging.getLogger("inflight.engine.weights")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors' names
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


class WeightUpdateError(ValueError):
    """The announcement does not fit the model (HTTP 400) — or, with status 409, the receiver is not ready or the
    version is stale."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_version(version: int, served: int, new_run: bool = False) -> None:
    """Versions never go back (`token_versions` within a choice are non-decreasing): an update older than the
    version served is a 409 on every transport. The same version again is allowed (a retry); so is an older one
    that says it starts a trainer (`new_run`: a new run, or one resumed from an older checkpoint)."""
    if version < served and not new_run:
        raise WeightUpdateError(f"stale version: the update announces v{version}, this server holds v{served}; "
                                "a weight version may not go back (but a trainer's first update may say new_run); "
                                "nothing applied", status=409)


def _problems(kind: str, problems: list[str], tail: str = "") -> None:
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} problems)" if len(problems) > 10 else "")
        raise WeightUpdateError(f"{kind} rejected: {shown}{tail}")


def check_params(params: list[ParamInfo], specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 aliases: dict[str, str] | None = None) -> None:
    """Raise WeightUpdateError naming every problem of the announced list (empty list of problems = fine).
    `aliases`: {alias: canonical name} of tied parameters (contracts.tied_aliases); an alias is refused with a
    message naming the one name the shared tensor travels under."""
    problems, seen = [], set()
    for p in params:
        if p.name in seen:
            problems.append(f"duplicate tensor {p.name!r}")
            continue
        seen.add(p.name)
        if aliases and p.name in aliases:
            problems.append(f"{p.name!r} is tied to {aliases[p.name]!r} (one tensor): send it once, under "
                            f"{aliases[p.name]!r}, and leave out {p.name!r}")
            continue
        if p.name not in specs:
            problems.append(f"unknown tensor {p.name!r}")
            continue
        shape, dtype = specs[p.name]
        if tuple(p.shape) != tuple(shape):
            problems.append(f"{p.name}: shape {list(p.shape)} != model's {list(shape)}")
        if DTYPES[p.dtype] != dtype:
            problems.append(f"{p.name}: dtype {p.dtype} != model's {DTYPE_NAMES.get(dtype, str(dtype))}")
    _problems("weight update", problems)


def check_adapter(params: list[ParamInfo], adapter: AdapterSpec,
                  specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  aliases: dict[str, str] | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """An adapter update's announcement against the model (docs/inference-contract.md, "Adapter updates"): the
    pairs of contracts.adapter_pairs, each base a 2-D parameter of the model (not a tied alias) with A [rank, in]
    and B [out, rank] of its [out, in], in its dtype. Raises WeightUpdateError naming every problem; returns the
    {tensor name: (shape, dtype)} to receive."""
    problems = []
    try:
        adapter_pairs(params, adapter.rank)
    except ValueError as e:
        problems.append(str(e))
    recv: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for p in params:
        suffix = next((s for s in LORA_SUFFIXES if p.name.endswith(s)), None)
        if suffix is None:
            continue  # named by adapter_pairs
        base = p.name[: -len(suffix)]
        if aliases and base in aliases:
            problems.append(f"{p.name!r}: base {base!r} is tied to {aliases[base]!r} (one tensor): adapt it under "
                            f"{aliases[base]!r}")
            continue
        if base not in specs:
            problems.append(f"{p.name!r}: unknown base weight {base!r}")
            continue
        shape, dtype = specs[base]
        if len(shape) != 2:
            problems.append(f"{p.name!r}: base {base!r} has shape {list(shape)}, not a matrix [out, in]")
            continue
        if len(p.shape) == 2:
            want = shape[1] if suffix == ".lora_A" else shape[0]
            got = p.shape[1] if suffix == ".lora_A" else p.shape[0]
            if got != want:
                problems.append(f"{p.name}: shape {list(p.shape)} does not fit base {base} {list(shape)} (lora_A is "
                                f"[rank, {shape[1]}], lora_B is [{shape[0]}, rank])")
        if DTYPES[p.dtype] != dtype:
            problems.append(f"{p.name}: dtype {p.dtype} != model's {DTYPE_NAMES.get(dtype, str(dtype))}")
        recv[p.name] = (tuple(p.shape), DTYPES[p.dtype])
    _problems("adapter update", problems, "; nothing changed")
    return recv


def check_announced(params: list[ParamInfo], adapter: AdapterSpec | None,
                    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    aliases: dict[str, str] | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """check_adapter or check_params, as the update says; the {name: (shape, dtype)} to receive."""
    if adapter is not None:
        return check_adapter(params, adapter, specs, aliases)
    check_params(params, specs, aliases)
    return specs


def infos(tensors: dict[str, torch.Tensor]) -> list[ParamInfo]:
    """The announcement a file's tensors amount to (400 for an empty file or a dtype no model has)."""
    bad_dtype = [n for n, t in tensors.items() if t.dtype not in DTYPE_NAMES]
    if bad_dtype:
        raise WeightUpdateError(f"weight update rejected: unsupported dtype in {bad_dtype[:5]}")
    if not tensors:
        raise WeightUpdateError("weight update rejected: the file holds no tensors")
    return [ParamInfo(name=n, shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype]) for n, t in tensors.items()]


def check_tensors(tensors: dict[str, torch.Tensor], specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  aliases: dict[str, str] | None = None, adapter: AdapterSpec | None = None) -> None:
    check_announced(infos(tensors), adapter, specs, aliases)


def check_finite(tensors: dict[str, torch.Tensor], what: str = "") -> None:
    """Raise WeightUpdateError naming the tensors that hold NaN or Inf (one fused reduction: inflight/transport/finite.py)."""
    bad = nonfinite(tensors)
    if bad:
        refuse_nonfinite(bad, what)


def refuse_nonfinite(bad: list[str], what: str = "") -> None:
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise WeightUpdateError(f"weight update rejected: NaN or Inf values in {what}{bad[:5]}{more}; nothing applied")


# ---- files ---------------------------------------------------------------------------------------------------------
def unreadable_file(path: str, why: str) -> WeightUpdateError:
    """The one refusal of a path that is not a readable safetensors file (the reason is logged, not answered)."""
    log.warning("weight update file %r refused: %s", path, why)
    return WeightUpdateError(f"weight update rejected: {path!r} is not a readable safetensors file on this "
                             "server's host (missing, unreadable, not a regular file, or not safetensors); "
                             "nothing applied")


def _absolute(path: str) -> None:
    if not os.path.isabs(path):
        raise WeightUpdateError(f"path must be absolute: {path!r}")


def safetensors_header(path: str) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype name)} from a safetensors header, without reading any tensor data. A FIFO or a device is
    never read (opened without blocking, then refused); OSError / ValueError for anything that is not one."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("file too short")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
            raise ValueError(f"header of {n} bytes does not fit the file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    out: dict[str, tuple[list[int], str]] = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        if not isinstance(v, dict) or not isinstance(v.get("shape"), list) or not isinstance(v.get("dtype"), str):
            raise ValueError(f"malformed header entry {k!r}")
        dtype: str = v["dtype"]
        out[k] = (list(v["shape"]), ST_DTYPES.get(dtype, dtype))
    return out


def file_params(path: str) -> list[ParamInfo]:
    """The tensors a safetensors file holds, from its header alone (nothing loaded): what /check_weight_update and
    an update check before reading the file."""
    _absolute(path)
    try:
        header = safetensors_header(path)
    except (OSError, ValueError) as e:  # json's errors are ValueErrors
        raise unreadable_file(path, str(e)) from None
    if not header:
        raise WeightUpdateError("weight update rejected: the file holds no tensors")
    bad = [n for n, (_, dt) in header.items() if dt not in DTYPES]
    if bad:
        raise WeightUpdateError(f"weight update rejected: unsupported dtype in {bad[:5]}")
    try:
        return [ParamInfo.model_validate({"name": n, "shape": s, "dtype": dt}) for n, (s, dt) in header.items()]
    except ValueError as e:  # a shape that is not a list of integers
        raise unreadable_file(path, str(e)) from None


def read_file(path: str) -> dict[str, torch.Tensor]:
    """safetensors only (never pickle): a plain file that the server process can read."""
    _absolute(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError("not a regular file")
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise unreadable_file(path, str(e)) from None


# ---- shared-memory segments ------------------------------------------------------------------------------------------
def check_shm(req) -> None:
    """The segment's header must announce exactly this version of exactly these tensors, being written or complete
    (400 otherwise; a segment that cannot be read is one message whatever the reason, which is logged)."""
    assert req.shm is not None and req.params is not None
    _, data_bytes = shm_layout(req.params)
    try:
        check_segment(req.shm.path, req.shm.bytes, req.version, data_bytes, announcement_digest(req.params))
    except UnreadableSegment as e:
        log.warning("shm segment %r refused: %s", req.shm.path, e.reason)
        raise WeightUpdateError(f"weight update rejected: {e}") from None
    except ShmError as e:
        raise WeightUpdateError(f"weight update rejected: {e}") from None


def wait_shm(req) -> None:
    """check_shm, then wait until the trainer has completed the segment (409 if it abandoned it or stopped
    writing): for readers that take a segment only whole."""
    check_shm(req)
    assert req.shm is not None and req.params is not None
    _, data_bytes = shm_layout(req.params)
    try:
        wait_complete(req.shm.path, req.version, data_bytes, announcement_digest(req.params))
    except ShmError as e:
        raise WeightUpdateError(f"weight update rejected: {e}; nothing applied", status=409) from None
