"""The same-device weight transport (`trainer.weight_transport: cuda_ipc`): the trainer keeps one flat buffer on its
GPU, shares it once by CUDA IPC handle, and copies each update into it; a server on the same GPU opens the handle
once and copies from that buffer into its weights (device to device, in place) at a step boundary, after checking
the update for NaN/Inf on the GPU. The shm transport's protocol with device memory: each push posts the
announcement and the buffer's handle (the same every time), the server opens a handle only the first time.

The buffer: an IPC_HEADER_BYTES header, then the announced tensors at the offsets of `contracts.shm_layout`. The
header says what the bytes are, so a server never applies bytes that are not the announced version of the
announced tensors:

    0 magic b"INFLWIPC"    8 weight version i64    16 data bytes u64    24 sha256 of the announcement (32 bytes)

The trainer zeroes the magic, copies the tensors, writes the header, synchronises its stream and only then posts;
it writes the buffer again only after every server answered (a push is synchronous), and after a failed push it
allocates a new buffer (a server that may still read the old one keeps it alive: the CUDA IPC reference count).

Nothing on the wire is pickled: a handle travels as the plain fields of `torch.UntypedStorage._share_cuda_()`
(binary ones base64) and is rebuilt with `_new_shared_cuda` after every field was checked (`check_handle`).

Without a GPU, the CPU stand-in (`kind` "cpu") is a shared-memory file that both sides map: the same protocol,
header and refusals, so they are tested on CPU.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import stat
import struct
import uuid
import weakref
from typing import Any

import torch

from inflight.transport.schemas import IpcBuffer
from inflight.transport.shm import TORCH_DTYPES, _map_owned, tensor_at

log = logging.getLogger("inflight.engine.weights")
IPC_MAGIC = b"INFLWIPC"
IPC_HEADER_BYTES = 256  # the data starts 256-byte aligned (shm_layout aligns each tensor to 64)
_HEADER = struct.Struct("<8sqQ32s")  # magic, version, data bytes, digest
_EVENT_BYTES = 64  # a cudaIpcEventHandle_t
_MAX_HANDLE = 1024  # bytes of any decoded handle field (a cudaIpcMemHandle is 64)
_REF_NAME = re.compile(rb"^/?[A-Za-z0-9_.\-]{1,255}$")  # the producer's ref-counter file: a plain shm name


class IpcError(ValueError):
    """A handle or buffer that is not what the announcement says (HTTP 400; 409 for a stale version)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(field: str, value: str | None, allow_empty: bool = False) -> bytes:
    if value is None or value == "":
        if allow_empty:
            return b""
        raise IpcError(f"ipc handle: {field} is missing")
    if len(value) > 4 * _MAX_HANDLE:
        raise IpcError(f"ipc handle: {field} is longer than {_MAX_HANDLE} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise IpcError(f"ipc handle: {field} is not base64") from None
    if not raw and not allow_empty:
        raise IpcError(f"ipc handle: {field} is empty")
    return raw


def export_buffer(buf: torch.Tensor, path: str | None = None) -> dict[str, Any]:
    """The handle of a contiguous uint8 buffer as plain JSON fields (`IpcBuffer`). CUDA: its storage shared by
    IPC; CPU: `path`, the shared-memory file the buffer maps."""
    nbytes = buf.numel()
    if buf.device.type == "cpu":
        assert path is not None
        return {"kind": "cpu", "bytes": nbytes, "path": path}
    if buf.storage_offset() != 0:
        raise IpcError("the ipc buffer must start at its storage")
    (device, handle, size, offset, ref_handle, ref_offset, event, sync) = buf.untyped_storage()._share_cuda_()
    return {"kind": "cuda", "bytes": nbytes, "device": int(device), "device_uuid": gpu_uuid(int(device)),
            "handle": _b64(handle),
            "storage_bytes": int(size), "storage_offset_bytes": int(offset), "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": int(ref_offset), "event_handle": _b64(event or b""),
            "event_sync_required": bool(sync)}


def gpu_uuid(index: int) -> str:
    """The UUID of a CUDA device: the same physical GPU whatever each process's CUDA_VISIBLE_DEVICES numbering."""
    return str(torch.cuda.get_device_properties(index).uuid)


def check_handle(ipc: IpcBuffer, data_bytes: int, device: torch.device, device_uuid: str | None = None) -> None:
    """Raise IpcError naming the problem unless `ipc` is a buffer of the announced size on this server's device
    with well-formed handle fields. Opens nothing. `device_uuid`: this server's GPU (default: looked up)."""
    want = IPC_HEADER_BYTES + data_bytes
    if ipc.bytes != want:
        raise IpcError(f"ipc buffer of {ipc.bytes} bytes, the announced tensors need header {IPC_HEADER_BYTES} + "
                       f"{data_bytes} bytes (shm_layout)")
    if ipc.kind == "cpu":
        if device.type != "cpu":
            raise IpcError(f"a cpu ipc buffer (the CPU stand-in) for a server on {device}: the trainer must share "
                           "its buffer from the server's device")
        if not ipc.path or not os.path.isabs(ipc.path):
            raise IpcError(f"ipc path must be absolute: {ipc.path!r}")
        _check_cpu_file(ipc.path, ipc.bytes)
        return
    if device.type != "cuda":
        raise IpcError("a cuda ipc buffer for a server on the CPU: cuda_ipc needs the server on the trainer's GPU")
    own = device.index if device.index is not None else torch.cuda.current_device()
    own_uuid = device_uuid if device_uuid is not None else gpu_uuid(own)
    if ipc.device != own or ipc.device_uuid != own_uuid:
        raise IpcError(f"ipc buffer on cuda:{ipc.device} (GPU {ipc.device_uuid}), this server is on cuda:{own} "
                       f"(GPU {own_uuid}): cuda_ipc needs the trainer and the server on one GPU (use "
                       "trainer.weight_transport=process_group)")
    _unb64("handle", ipc.handle)
    ref = _unb64("ref_counter_handle", ipc.ref_counter_handle)
    if not _REF_NAME.match(ref):
        raise IpcError("ipc handle: ref_counter_handle is not a shared-memory name")
    event = _unb64("event_handle", ipc.event_handle, allow_empty=True)
    if ipc.event_sync_required and len(event) != _EVENT_BYTES:
        raise IpcError(f"ipc handle: event_sync_required needs an event_handle of {_EVENT_BYTES} bytes "
                       f"(got {len(event)})")
    if ipc.bytes > ipc.storage_bytes:  # the buffer starts at the storage (export_buffer)
        raise IpcError(f"ipc handle: a storage of {ipc.storage_bytes} bytes cannot hold the buffer's {ipc.bytes} "
                       "bytes")


def _check_cpu_file(path: str, size: int) -> None:
    """The CPU stand-in's file: a regular file of `size` bytes starting with the magic. One message whatever is
    wrong (the reason is logged): a client may not learn which files exist on the server's host, or their size."""
    try:  # opened without blocking and checked on the descriptor: a FIFO or a device is never read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"{st.st_size} bytes" if st.st_size != size else
                   "bad magic (being written, or not a buffer)" if f.read(len(IPC_MAGIC)) != IPC_MAGIC else "")
    except OSError as e:
        why = e.strerror or str(e)
    if why:
        log.warning("ipc buffer %r refused: %s", path, why)
        raise IpcError(f"{path!r} is not a readable ipc buffer of {size} bytes on this server's host (missing, "
                       "unreadable, another size, or being written)")


def open_buffer(ipc: IpcBuffer) -> torch.Tensor:
    """The buffer as a flat uint8 tensor on this process's device (check_handle first). CPU: mapped read-only."""
    if ipc.kind == "cpu":
        assert ipc.path is not None
        return _map_owned(ipc.path, ipc.bytes)
    event = _unb64("event_handle", ipc.event_handle, allow_empty=True)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            ipc.device, _unb64("handle", ipc.handle), ipc.storage_bytes, ipc.storage_offset_bytes,
            _unb64("ref_counter_handle", ipc.ref_counter_handle), ipc.ref_counter_offset, event,
            ipc.event_sync_required)  # torch takes the event handle as bytes, read only when sync is required
    except RuntimeError as e:
        raise IpcError(f"cannot open the ipc handle on cuda:{ipc.device}: {str(e).splitlines()[0][:200]}") from None
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", ipc.device)).set_(storage)
    return t[: ipc.bytes]


def read_header(buf: torch.Tensor) -> tuple[bytes, int, int, bytes]:
    """(magic, version, data bytes, digest) of a buffer (one small device-to-host copy on a GPU)."""
    return _HEADER.unpack(bytes(buf[: _HEADER.size].cpu().numpy().tobytes()))


def check_header(buf: torch.Tensor, version: int, data_bytes: int, digest: bytes) -> None:
    magic, got_version, got_bytes, got_digest = read_header(buf)
    if magic != IPC_MAGIC:
        raise IpcError("the ipc buffer holds no complete update (bad magic: being written, or not a buffer)")
    if got_version != version:
        raise IpcError(f"the ipc buffer holds weight version {got_version}, the update announces {version}")
    if got_bytes != data_bytes or got_digest != digest:
        raise IpcError("the ipc buffer holds other tensors than announced (names, shapes or dtypes differ)")


def views(buf: torch.Tensor, entries: list[tuple[str, list[int], str, int]]) -> dict[str, torch.Tensor]:
    """{name: view} of entries (name, shape, dtype name, data offset)."""
    data = buf[IPC_HEADER_BYTES:]
    return {name: tensor_at(data, off, shape, TORCH_DTYPES[dt]) for name, shape, dt, off in entries}


class IpcWriter:
    """The trainer's buffer: allocated on first use on `device` (CPU: a file under `shm_dir`, the stand-in),
    reused while the size stays the same, replaced after a failed push (`discard`)."""

    def __init__(self, device: torch.device | None, shm_dir: str = "/dev/shm"):
        self.device = device  # None: the device of the tensors pushed first
        self.layout: tuple | None = None  # (announcement, offsets, data bytes, digest): kept by ipc_push
        self.shm_dir = shm_dir
        self.buf: torch.Tensor | None = None
        self.handle: dict[str, Any] | None = None
        self.path: str | None = None
        self._finalizer: Any = None

    def write(self, tensors: list[tuple[str, torch.Tensor]], dtypes: list[str], offsets: list[int],
              data_bytes: int, version: int, digest: bytes) -> dict[str, Any]:
        """Copy the update into the buffer (converted to the announced dtypes), header last, and wait until the
        device has done it; returns the `ipc` field of the announcement."""
        size = IPC_HEADER_BYTES + data_bytes
        if self.buf is None or self.buf.numel() != size:
            self.discard()
            self._allocate(size, self.device or (tensors[0][1].device if tensors else torch.device("cpu")))
        buf = self.buf
        assert buf is not None and self.handle is not None
        buf[:8].zero_()  # no version is claimed while the bytes change
        data = buf[IPC_HEADER_BYTES:]
        with torch.no_grad():
            for (_, t), dt, off in zip(tensors, dtypes, offsets, strict=True):
                tensor_at(data, off, list(t.shape), TORCH_DTYPES[dt]).copy_(t)  # converts dtype / device
            header = torch.frombuffer(bytearray(_HEADER.pack(IPC_MAGIC, version, data_bytes, digest)),
                                      dtype=torch.uint8)
            buf[: _HEADER.size].copy_(header)
        if buf.device.type == "cuda":
            torch.cuda.current_stream(buf.device).synchronize()  # the server reads on its own stream
        return self.handle

    def _allocate(self, size: int, device: torch.device) -> None:
        if device.type == "cuda":
            self.buf = torch.empty(size, dtype=torch.uint8, device=device)
            self.handle = export_buffer(self.buf)
            return
        path = os.path.join(self.shm_dir, f"inflight-ipc-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # a tmpfs too small fails here, not with SIGBUS later
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise IpcError(f"cannot reserve {size / 2**20:.0f} MiB in {self.shm_dir}: {e.strerror}") from None
        os.close(fd)
        storage = torch.UntypedStorage.from_file(path, True, size)
        # torch's stub gives from_file any storage type; it returns an UntypedStorage, which set_ takes
        self.buf = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
        self.path, self.handle = path, export_buffer(self.buf, path)
        self._finalizer = weakref.finalize(self, _unlink, path)

    def discard(self) -> None:
        """Let the buffer go: a server still holding it keeps it (IPC reference count / its own mapping), and it is
        never written again."""
        self.buf, self.handle, self.path = None, None, None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
