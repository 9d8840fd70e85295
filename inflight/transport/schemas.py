"""The weight-update contract's wire schemas (docs/inference-contract.md, "Weight updates"): the JSON bodies of
`POST /init_process_group` and `POST /request_weight_update`, validated by every server before anything changes."""

from __future__ import annotations

from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

WeightDType = Literal["float32", "bfloat16", "float16"]
UpdateMode = Literal["keep", "interrupt"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_GROUP_TIMEOUT_S = 600.0  # the most a process group's rendezvous or broadcast may wait
MAX_VERSION = 2**63 - 1  # versions travel as i64 (shm and ipc headers)


class InitProcessGroupRequest(_Strict):
    """Join the weight-update process group. Rank 0 (the trainer) hosts a TCPStore at master_address:master_port;
    each member builds the group directly on that store, no key prefix, separate from any default group."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="this server's first rank; the trainer is rank 0")
    world_size: int = Field(ge=2)
    backend: Literal["gloo", "nccl"] = "gloo"
    group_name: str = "inflight_weights"
    # the rendezvous and every broadcast of the group wait at most this long: bounded, so no request can make a
    # server wait on a group for longer (docs/inference-contract.md)
    timeout_s: float = Field(default=MAX_GROUP_TIMEOUT_S, gt=0, le=MAX_GROUP_TIMEOUT_S)


class ParamInfo(_Strict):
    name: str = Field(min_length=1)
    shape: list[int]
    dtype: WeightDType


class ShmSegment(_Strict):
    """A shared-memory segment of the same host holding an update (the trainer writes it once, every server on the
    host copies from it): a file of `bytes` bytes on a memory file system (/dev/shm), a SHM_HEADER_BYTES header
    (inflight/transport/shm.py: format, state, weight version, digest of the announcement, bytes written so far)
    then the tensors of `params` at the offsets of `shm_layout`."""

    path: str = Field(min_length=1)
    bytes: int = Field(gt=0, le=2**44)
    # a promise to leave these bytes alone until the next update is answered: accepted, and changes nothing (a server
    # cannot check it, so it copies every segment: docs/inference-contract.md, "Shared-memory segments")
    lend: bool = False


class IpcBuffer(_Strict):
    """The trainer's flat update buffer, shared by handle with servers on its own device (transport `cuda_ipc`,
    inflight/transport/cuda_ipc.py): IPC_HEADER_BYTES of header (magic, weight version, digest of the announcement), then the
    tensors of `params` at the offsets of `shm_layout`. The trainer exports it once and copies each update into it;
    the server opens it once and copies from it. Plain fields only: nothing is unpickled. `kind` "cuda": the
    fields of `torch.UntypedStorage._share_cuda_()` (binary ones base64); "cpu": the CPU stand-in, a shared-memory
    file at `path`."""

    kind: Literal["cuda", "cpu"]
    bytes: int = Field(gt=0, le=2**44, description="header + data: the part of the storage the update uses")
    device: int = Field(default=-1, ge=-1, description="CUDA device index (in the server's numbering); -1 for cpu")
    device_uuid: str | None = Field(default=None, max_length=64)  # cuda: the GPU's UUID (the same physical device)
    path: str | None = None  # cpu
    handle: str | None = None  # cuda: base64 cudaIpcMemHandle of the allocation
    storage_bytes: int = Field(default=0, ge=0)  # cuda: size of the shared storage
    storage_offset_bytes: int = Field(default=0, ge=0)  # cuda: where the storage starts in the allocation
    ref_counter_handle: str | None = None  # cuda: base64 name of the producer's reference-count file
    ref_counter_offset: int = Field(default=0, ge=0)
    event_handle: str | None = None  # cuda: base64 cudaIpcEventHandle (empty when no sync is required)
    event_sync_required: bool = False


class AdapterSpec(_Strict):
    """A LoRA adapter update (docs/inference-contract.md, "Adapter updates"): every announced tensor is
    `<base>.lora_A` [rank, in] or `<base>.lora_B` [out, rank], where `<base>` names a 2-D parameter [out, in] of
    the model; the server computes W = W0 + scaling * B @ A for each base and keeps W0 (the base weights)."""

    rank: int = Field(ge=1, le=65536)
    scaling: float = Field(allow_inf_nan=False)


LORA_SUFFIXES = (".lora_A", ".lora_B")


def adapter_pairs(params: list[ParamInfo], rank: int) -> dict[str, tuple[ParamInfo, ParamInfo]]:
    """{base name: (A, B)} of an adapter update's tensors, or ValueError naming every problem: a name without a
    .lora_A/.lora_B suffix, a base missing its A or its B, a tensor not 2-D, a rank other than `rank`, A and B of
    different dtypes. Whether each base exists in the model, with shape [B rows, A columns], is the server's check."""
    problems: list[str] = []
    halves: dict[str, dict[str, ParamInfo]] = {}
    for p in params:
        suffix = next((s for s in LORA_SUFFIXES if p.name.endswith(s)), None)
        if suffix is None or len(p.name) == len(suffix):
            problems.append(f"'{p.name}' is not '<base>.lora_A' or '<base>.lora_B'")
            continue
        halves.setdefault(p.name[: -len(suffix)], {})[suffix] = p
    pairs: dict[str, tuple[ParamInfo, ParamInfo]] = {}
    for base, h in halves.items():
        a, b = h.get(".lora_A"), h.get(".lora_B")
        if a is None or b is None:
            problems.append(f"'{base}' has {'no .lora_A' if a is None else 'no .lora_B'}")
            continue
        if len(a.shape) != 2 or len(b.shape) != 2:
            problems.append(f"'{base}': lora_A {a.shape} and lora_B {b.shape} must both be 2-D")
            continue
        if a.shape[0] != rank or b.shape[1] != rank:
            problems.append(f"'{base}': lora_A {a.shape} and lora_B {b.shape} do not have rank {rank} "
                            "(A is [rank, in], B is [out, rank])")
            continue
        if a.dtype != b.dtype:
            problems.append(f"'{base}': lora_A is {a.dtype}, lora_B is {b.dtype}")
            continue
        pairs[base] = (a, b)
    if problems:
        raise ValueError("; ".join(problems))
    return pairs


def served_adapter_name(prefix: str, version: int) -> str:
    """The name a LoRA run's adapter of `version` is loaded under on stock vLLM servers (trainer.protocol=vllm):
    requests that name it run under exactly that version (the trainer loads it, the actor asks for it)."""
    return f"{prefix}-v{int(version)}"


class WeightUpdateRequest(_Strict):
    """Announce an update. Exactly one transport: `params` alone (broadcasts from rank 0, in this order: one per
    tensor, or with `bucket_bytes` > 0 one per bucket of `bucket_layout`), `params` with `shm` (a shared-memory
    segment on the server's host), or `path` (a safetensors file readable on the server's host, e.g. under
    /dev/shm)."""

    version: int = Field(ge=0, le=MAX_VERSION, description=(
        "never lower than the version the server holds (409), unless `new_run`"))
    new_run: bool = Field(default=False, description=(
        "the first update of a trainer (a new run, or one resumed from an older checkpoint): its version may be "
        "lower than the one served"))
    params: list[ParamInfo] | None = None
    path: str | None = None
    shm: ShmSegment | None = None
    ipc: IpcBuffer | None = None  # the trainer's device buffer (same device): transport cuda_ipc
    mode: UpdateMode = "keep"
    bucket_bytes: int = Field(default=0, ge=0, le=2**40, description=(
        "0: one broadcast per tensor; > 0: tensors packed into flat byte buffers of at most this size (bucket_layout)"))
    adapter: AdapterSpec | None = Field(default=None, description=(
        "set: the tensors are a LoRA adapter (adapter_pairs) merged into the kept base weights; a full update "
        "(adapter unset) replaces the base weights and drops any adapter"))

    @model_validator(mode="after")
    def _one_transport(self) -> "WeightUpdateRequest":
        if (self.params is None) == (self.path is None):
            raise ValueError("give exactly one of 'params' (process-group broadcast or 'shm' segment) or 'path' "
                             "(safetensors file)")
        if self.shm is not None and self.params is None:
            raise ValueError("'shm' needs 'params' (the tensors the segment holds, in order)")
        if self.ipc is not None and (self.params is None or self.shm is not None or self.bucket_bytes):
            raise ValueError("'ipc' needs 'params' (the tensors the buffer holds, in order), without 'shm' or "
                             "'bucket_bytes' (the buffer has the layout of shm_layout)")
        if self.shm is not None and self.bucket_bytes:
            raise ValueError("'bucket_bytes' is for broadcasts; an 'shm' segment has its own layout (shm_layout)")
        if self.params is not None:
            dup = {n for n, k in Counter(p.name for p in self.params).items() if k > 1}
            if dup:
                raise ValueError(f"duplicate tensor names: {sorted(dup)}")
            if not self.params:
                raise ValueError("'params' is empty")
            if self.adapter is not None:
                adapter_pairs(self.params, self.adapter.rank)
        return self


class WeightUpdateResponse(BaseModel):
    version: int
    pause_s: float
