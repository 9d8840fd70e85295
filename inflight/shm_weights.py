"""The shared-memory weight transport (same host): the trainer writes an update once into a segment on a memory file
system (/dev/shm), and every server on the host copies it into its model from there — the CPU counterpart of CUDA
IPC. Two copies in all (trainer -> segment, segment -> model), no socket, no serialisation, nothing unpickled.

A segment is a file: a SHM_HEADER_BYTES header, then the tensors of the announcement at the offsets of
`contracts.shm_layout` (C order, the announced dtypes). The header says what the bytes are:

    0  magic  b"INFLWSHM"     8  format u32 (SHM_FORMAT)     16  weight version i64     24  data bytes u64
    32 sha256 of the announcement (`announcement_digest`: names, shapes, dtypes in order)

so a server applies the bytes only if they are the announced version of the announced tensors. The trainer reuses
one segment while the announcement stays the same (its pages stay mapped on both sides: no page faults after the
first push), writes it only when no server is reading it (the previous update was answered by all), invalidates the
header before writing and completes it last, and after any failed update starts a new segment (a server that may
still be reading keeps its mapping of the old file, which nobody writes again).

Only the standard library and torch are imported here: vLLM's workers use it in vLLM's environment.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import struct
import uuid
import warnings
import weakref
from typing import Any, Iterable

import torch

SHM_MAGIC = b"INFLWSHM"
SHM_FORMAT = 1
SHM_HEADER_BYTES = 4096  # the data starts on a page boundary
_HEADER = struct.Struct("<8sIIqQ32s")  # magic, format, reserved, version, data bytes, digest
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page at once instead of one fault per 4 KiB page
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ShmError(ValueError):
    """The segment is missing, unreadable, or does not hold what the announcement says (HTTP 400)."""


def announcement_digest(params: Iterable[Any]) -> bytes:
    """sha256 of the announced tensors in order (objects with .name, .shape, .dtype, or (name, shape, dtype))."""
    rows = [[p.name, list(p.shape), p.dtype] if hasattr(p, "name") else [p[0], list(p[1]), p[2]] for p in params]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).digest()


def pack_header(version: int, data_bytes: int, digest: bytes) -> bytes:
    return _HEADER.pack(SHM_MAGIC, SHM_FORMAT, 0, version, data_bytes, digest)


def check_segment(path: str, size: int, version: int, data_bytes: int, digest: bytes) -> None:
    """Raise ShmError naming the problem unless `path` is a segment of `size` bytes whose header announces exactly
    this version, data size and announcement digest. Reads the header only."""
    if not os.path.isabs(path):
        raise ShmError(f"shm path must be absolute: {path!r}")
    if size != SHM_HEADER_BYTES + data_bytes:
        raise ShmError(f"shm segment size {size} != header {SHM_HEADER_BYTES} + the announced tensors' "
                       f"{data_bytes} bytes (shm_layout)")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ShmError(f"no shm segment {path!r} on this server's host: the shm transport needs the trainer and the "
                       "server on one host (use trainer.weight_transport=process_group across hosts)") from None
    except OSError as e:
        raise ShmError(f"cannot read shm segment {path!r}: {e}") from None
    if not stat.S_ISREG(st.st_mode):  # never open a FIFO or a device: reading one could block or never end
        raise ShmError(f"shm segment {path!r} is not a regular file")
    if st.st_size != size:
        raise ShmError(f"shm segment {path!r} has {st.st_size} bytes, the announcement says {size}")
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError as e:
        raise ShmError(f"cannot read shm segment {path!r}: {e}") from None
    magic, fmt, _, got_version, got_bytes, got_digest = _HEADER.unpack(raw)
    if magic != SHM_MAGIC:
        raise ShmError(f"{path!r} is not a complete inflight weight segment (bad magic: being written, or not one)")
    if fmt != SHM_FORMAT:
        raise ShmError(f"shm segment format {fmt}, this server reads format {SHM_FORMAT}")
    if got_version != version:
        raise ShmError(f"shm segment holds weight version {got_version}, the update announces {version}")
    if got_bytes != data_bytes or got_digest != digest:
        raise ShmError("shm segment holds other tensors than announced (names, shapes or dtypes differ)")


def _map(fd: int, size: int, writable: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=prot)


def _bytes_view(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: torch warns that the tensor must not be written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


def tensor_at(data: torch.Tensor, offset: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return data[offset: offset + n].view(dtype).view(tuple(shape))


class ShmMapping:
    """A server's read-only mapping of segments, kept while the trainer reuses the same file (same inode)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._mm: mmap.mmap | None = None
        self._data: torch.Tensor | None = None

    def tensors(self, path: str, entries: Iterable[tuple[str, list[int], str, int]]) -> dict[str, torch.Tensor]:
        """{name: view} for entries (name, shape, dtype name, data offset); views stay valid until the next call
        with another segment. The caller has checked the segment (check_segment)."""
        st = os.stat(path)
        key = (path, st.st_ino, st.st_dev, st.st_size)
        if key != self._key:
            self.close()
            fd = os.open(path, os.O_RDONLY)
            try:
                self._mm = _map(fd, st.st_size, writable=False)
            finally:
                os.close(fd)  # the mapping keeps the file
            self._data = _bytes_view(self._mm)[SHM_HEADER_BYTES:]
            self._key = key
        data = self._data
        return {name: tensor_at(data, off, shape, TORCH_DTYPES[dt]) for name, shape, dt, off in entries}

    def close(self) -> None:
        self._key, self._data = None, None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with it
                pass


class ShmWriter:
    """The trainer's segment: created on first use in `directory`, reused while the layout stays the same."""

    def __init__(self, directory: str = "/dev/shm"):
        self.directory = directory
        self.path: str | None = None
        self._size = 0
        self._finalizer: weakref.finalize | None = None
        self._mm: mmap.mmap | None = None
        self._data: torch.Tensor | None = None

    def write(self, tensors: list[tuple[str, torch.Tensor]], dtypes: list[str], offsets: list[int],
              data_bytes: int, version: int, digest: bytes) -> dict[str, Any]:
        """Copy every tensor (converted to its announced dtype) to its offset; returns the `shm` field of the
        announcement. The header is invalid while the data is being written."""
        size = SHM_HEADER_BYTES + data_bytes
        if self._mm is None or size != self._size:
            self.discard()
            self._create(size)
        assert self._mm is not None and self._data is not None
        self._mm[:_HEADER.size] = bytes(_HEADER.size)  # invalid until the data is complete
        for (_, t), dt, off in zip(tensors, dtypes, offsets):
            tensor_at(self._data, off, list(t.shape), TORCH_DTYPES[dt]).copy_(t)  # converts dtype / device
        self._mm[:_HEADER.size] = pack_header(version, data_bytes, digest)
        return {"path": self.path, "bytes": size}

    def _create(self, size: int) -> None:
        path = os.path.join(self.directory, f"inflight-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:  # reserve the pages now: writing past the free space of a tmpfs kills the process with SIGBUS
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                free = os.statvfs(self.directory)
                raise ShmError(
                    f"cannot reserve {size / 2**20:.0f} MiB in {self.directory} ({e.strerror}; "
                    f"{free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): give the container more shared memory "
                    "(docker --shm-size) or point trainer.shm_dir at a larger memory file system") from None
            self._mm = _map(fd, size, writable=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path, self._size = path, size
        self._data = _bytes_view(self._mm)[SHM_HEADER_BYTES:]
        # a writer dropped without discard(), or an interpreter that exits, still removes the file (it is memory);
        # only a killed process leaves one behind (its pid is in the name)
        self._finalizer = weakref.finalize(self, _unlink, path)

    def discard(self) -> None:
        """Remove the segment (a server still mapping it keeps its pages until it lets go)."""
        self._data = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
        if self._finalizer is not None:
            self._finalizer()  # unlinks now, once
            self._finalizer = None
        self.path, self._size = None, 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
