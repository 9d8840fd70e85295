"""The shared-memory weight transport (same host): the trainer writes an update once into a segment on a memory file
system (/dev/shm), and every server on the host copies it into its model from there — the CPU counterpart of CUDA
IPC. Two copies in all (trainer -> segment, segment -> the server's own memory), no socket, no serialisation,
nothing unpickled.

A segment is a file: a SHM_HEADER_BYTES header, then the tensors of the announcement at the offsets of
`contracts.shm_layout` (C order, the announced dtypes). The header says what the bytes are (format 2):

    0  magic  b"INFLWSHM"     8  format u32 (SHM_FORMAT)     12  state u32 (WRITING, COMPLETE, ABANDONED)
    16 weight version i64     24 data bytes u64     32 sha256 of the announcement (`announcement_digest`)
    64 written u64: the first `written` bytes of the data hold their final values (= data bytes when COMPLETE)

so a server applies the bytes only if they are the announced version of the announced tensors, complete. The two
copies overlap: the trainer announces the update when it starts writing (state WRITING) and raises `written` as it
goes, in announced order, and a server copies each tensor as soon as `written` has passed it (`SegmentWatch`); it
applies nothing before the state is COMPLETE with the same header, and gives up with a clear error when the state
turns ABANDONED (the trainer failed midway) or `written` stops moving for `stall_seconds()` (the trainer died).
Readers that want the whole segment at once (the vLLM backend) wait for COMPLETE first (`wait_complete`).
Why that order is safe without locks: x86-64 keeps stores in program order as other cores see them and loads in
program order, so a server that reads `written` (one aligned 8-byte load) and then the data sees what was written
before it. Elsewhere (`progress_is_ordered()` false) the trainer completes the segment before it announces it, and
the announcement's HTTP round trip orders the bytes, as in format 1.

The trainer reuses one segment while the announcement stays the same (its pages stay mapped on both sides: no page
faults after the first push), writes it only when no server is reading it (the previous update was answered by
all), invalidates the magic before writing a new header, and after any failed update starts a new segment (a server
that may still be reading keeps its mapping of the old file, which nobody writes again).

A server copies every segment: the trainer keeps it writable (and writes it again at the next update), so a server
reads each byte once, into memory of its own, and applies only what it checked there (engine/weights/receiver.py).
An announcement's `lend` flag (a promise to leave the segment alone, which a server could not check) is accepted
and changes nothing. A server's mappings are torch storages made read-only.

A path that is not a readable segment of the announced size gets one message (`UnreadableSegment`) whatever the
reason, which only the server logs: a client cannot probe which files exist on the server's host, or their size.

Only the standard library and torch are imported here: vLLM's workers use it in vLLM's environment.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import platform
import stat
import struct
import time
import uuid
import warnings
import weakref
from typing import Any, Iterable

import torch

SHM_MAGIC = b"INFLWSHM"
SHM_FORMAT = 2  # 1: no state and no progress (a server read only complete segments)
SHM_HEADER_BYTES = 4096  # the data starts on a page boundary
_HEADER = struct.Struct("<8sIIqQ32sQ")  # magic, format, state, version, data bytes, digest, written
_STATE_AT, _WRITTEN_AT = 12, 64  # the two fields that change while the data is written (aligned: one load/store)
WRITING, COMPLETE, ABANDONED = 1, 2, 3
_STATES = {WRITING: "being written", COMPLETE: "complete", ABANDONED: "abandoned by the trainer"}
CHUNK_BYTES = 4 << 20  # the trainer publishes its progress (and a server follows it) in steps of about this much
STALL_S = 10.0  # default of INFLIGHT_SHM_STALL_S
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page at once instead of one fault per 4 KiB page
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ShmError(ValueError):
    """The segment is missing, unreadable, or does not hold what the announcement says (HTTP 400)."""


class UnreadableSegment(ShmError):
    """A path that is not a readable segment of the announced size: one message whatever the reason (missing,
    unreadable, not a regular file, another size, no segment header), so a client cannot probe the server's files;
    `reason` says which, for the server's log."""

    def __init__(self, path: str, size: int, reason: str):
        super().__init__(f"{path!r} is not a readable inflight weight segment of {size} bytes on this server's host "
                         "(missing, unreadable, another size, or its header is being written); the shm transport "
                         "needs the trainer and the server on one host (use trainer.weight_transport=process_group "
                         "across hosts)")
        self.reason = reason


def announcement_digest(params: Iterable[Any]) -> bytes:
    """sha256 of the announced tensors in order (objects with .name, .shape, .dtype, or (name, shape, dtype))."""
    rows = [[p.name, list(p.shape), p.dtype] if hasattr(p, "name") else [p[0], list(p[1]), p[2]] for p in params]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).digest()


def pack_header(version: int, data_bytes: int, digest: bytes, state: int = COMPLETE) -> bytes:
    written = data_bytes if state == COMPLETE else 0
    return _HEADER.pack(SHM_MAGIC, SHM_FORMAT, state, version, data_bytes, digest, written)


def progress_is_ordered() -> bool:
    """Whether a server may follow `written` while the trainer writes (stores seen in program order: x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def stall_seconds() -> float:
    """How long a server waits for a segment being written to make progress (env INFLIGHT_SHM_STALL_S)."""
    return float(os.environ.get("INFLIGHT_SHM_STALL_S", STALL_S))


def check_segment(path: str, size: int, version: int, data_bytes: int, digest: bytes,
                  complete: bool = False) -> None:
    """Raise ShmError naming the problem unless `path` is a segment of `size` bytes whose header announces exactly
    this version, data size and announcement digest, being written or complete (`complete`: complete only).
    Reads the header only."""
    if not os.path.isabs(path):
        raise ShmError(f"shm path must be absolute: {path!r}")
    if size != SHM_HEADER_BYTES + data_bytes:
        raise ShmError(f"shm segment size {size} != header {SHM_HEADER_BYTES} + the announced tensors' "
                       f"{data_bytes} bytes (shm_layout)")
    try:  # opened without blocking and checked on the descriptor: a FIFO or a device is never read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnreadableSegment(path, size, "not a regular file")
            if st.st_size != size:
                raise UnreadableSegment(path, size, f"{st.st_size} bytes")
            raw = f.read(_HEADER.size)
    except OSError as e:
        raise UnreadableSegment(path, size, e.strerror or str(e)) from None
    if len(raw) != _HEADER.size or raw[:8] != SHM_MAGIC:
        raise UnreadableSegment(path, size, "bad magic (being written, or not a segment)")
    _check_header(_HEADER.unpack(raw), path, version, data_bytes, digest, complete)


def _check_header(fields: tuple, path: str, version: int, data_bytes: int, digest: bytes, complete: bool) -> int:
    """The header's state, unless it is not this version of these tensors (ShmError)."""
    magic, fmt, state, got_version, got_bytes, got_digest, _ = fields
    if magic != SHM_MAGIC:
        raise ShmError(f"{path!r} is not a complete inflight weight segment (bad magic: being written, or not one)")
    if fmt != SHM_FORMAT:
        raise ShmError(f"shm segment format {fmt}, this server reads format {SHM_FORMAT}")
    if got_version != version:
        raise ShmError(f"shm segment holds weight version {got_version}, the update announces {version}")
    if got_bytes != data_bytes or got_digest != digest:
        raise ShmError("shm segment holds other tensors than announced (names, shapes or dtypes differ)")
    if state == ABANDONED or state not in _STATES or (complete and state != COMPLETE):
        raise ShmError(f"shm segment of v{version} is {_STATES.get(state, f'in state {state}')}, not complete")
    return state


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


class SegmentWatch:
    """A reader's view of a segment's progress: waits until the trainer has written a part (`ready`) or all of it
    (`wait_complete`), raising ShmError when the trainer abandoned the update, rewrote the header, or wrote nothing
    for `stall_s` seconds. `header` keeps the mapping that holds the header (and, for `ready`, the data) alive."""

    def __init__(self, header: torch.Tensor, path: str, version: int, data_bytes: int, digest: bytes,
                 stall_s: float | None = None):
        self._header, self.path = header, path  # uint8 view of the header page (the data follows it)
        self.version, self.data_bytes, self.digest = version, data_bytes, digest
        self.stall_s = stall_seconds() if stall_s is None else stall_s
        addr = header.data_ptr()
        self._state = ctypes.c_uint32.from_address(addr + _STATE_AT)  # aligned: one load each
        self._written = ctypes.c_uint64.from_address(addr + _WRITTEN_AT)
        self._data_addr = addr + SHM_HEADER_BYTES
        self._done = 0  # the largest `written` seen: bytes below it are final

    def ready(self, view: torch.Tensor) -> None:
        """Wait until the bytes of `view` (a contiguous view of this segment's data) are final."""
        end = view.data_ptr() - self._data_addr + view.numel() * view.element_size()
        if end > self._done:
            self._wait(end)

    def wait_complete(self) -> None:
        """Wait until the segment is complete, and check that its header still announces this update."""
        self._wait(self.data_bytes, complete=True)
        fields = _HEADER.unpack(ctypes.string_at(self._header.data_ptr(), _HEADER.size))
        _check_header(fields, self.path, self.version, self.data_bytes, self.digest, complete=True)
        if fields[-1] != self.data_bytes:
            raise ShmError(f"shm segment of v{self.version} is marked complete with {fields[-1]} of "
                           f"{self.data_bytes} bytes written")

    def _wait(self, end: int, complete: bool = False) -> None:
        last, since, nap = -1, time.monotonic(), 20e-6
        while True:
            state = self._state.value  # before `written`: the trainer raises `written` before it says COMPLETE
            written = self._written.value
            if state == COMPLETE or (state == WRITING and written >= end and not complete):
                self._done = max(self._done, min(written, self.data_bytes))
                return
            if state != WRITING or written > self.data_bytes:
                what = "abandoned by the trainer (it failed while writing)" if state == ABANDONED else \
                    f"rewritten while being read (state {state}, {written} bytes written)"
                raise ShmError(f"shm segment of v{self.version} was {what} at {written} of {self.data_bytes} bytes")
            now = time.monotonic()
            if written != last:
                last, since = written, now
            elif now - since > self.stall_s:
                raise ShmError(f"the trainer stopped writing the shm segment of v{self.version}: no progress for "
                               f"{self.stall_s:g}s at {written} of {self.data_bytes} bytes (INFLIGHT_SHM_STALL_S)")
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)


def wait_complete(path: str, version: int, data_bytes: int, digest: bytes, stall_s: float | None = None) -> None:
    """For readers that take a segment only whole (the vLLM backend): wait until the trainer has completed it.
    The caller has checked the segment (check_segment); only its header page is mapped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ShmError(f"cannot read shm segment {path!r}: {e}") from None
    try:
        mm = _map(fd, SHM_HEADER_BYTES, writable=False)
    finally:
        os.close(fd)
    header = _bytes_view(mm)
    try:
        SegmentWatch(header, path, version, data_bytes, digest, stall_s).wait_complete()
    finally:
        del header
        try:
            mm.close()
        except BufferError:
            pass


class ShmMapping:
    """A server's read-only mappings of segments, kept while the trainer reuses the same files (same inodes): the
    last `keep` of them, so a trainer that writes two segments in turn is mapped once.
    A mapping is owned by the tensors made from it (a torch storage): a view still in use keeps its segment mapped
    after this object let go of it."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._maps: dict[tuple, torch.Tensor] = {}  # (path, inode, device, size) -> the whole file as bytes
        self._last: tuple | None = None

    def tensors(self, path: str, entries: Iterable[tuple[str, list[int], str, int]]) -> dict[str, torch.Tensor]:
        """{name: view} for entries (name, shape, dtype name, data offset). The caller has checked the segment
        (check_segment)."""
        st = os.stat(path)
        key = (path, st.st_ino, st.st_dev, st.st_size)
        if key not in self._maps:
            self._maps = {k: v for k, v in self._maps.items() if k[0] != path}  # a file replaced under that name
            while len(self._maps) >= self.keep:
                self._maps.pop(next(iter(self._maps)))
            self._maps[key] = _map_owned(path, st.st_size)
        else:
            self._maps[key] = self._maps.pop(key)  # most recently used last
        self._last = key
        data = self._maps[key][SHM_HEADER_BYTES:]
        return {name: tensor_at(data, off, shape, TORCH_DTYPES[dt]) for name, shape, dt, off in entries}

    def watch(self, version: int, data_bytes: int, digest: bytes, stall_s: float | None = None) -> SegmentWatch:
        """The progress of the segment mapped by the last tensors() call (whose views `ready` accepts)."""
        assert self._last is not None and self._last in self._maps
        return SegmentWatch(self._maps[self._last][:SHM_HEADER_BYTES], self._last[0], version, data_bytes, digest,
                            stall_s)

    def close(self) -> None:
        self._maps, self._last = {}, None


def _map_owned(path: str, size: int) -> torch.Tensor:
    """The file mapped shared into a torch storage (unmapped when its last tensor goes), then made read-only (a
    write into it is a crash here, never a change to the trainer's bytes) and faulted in at once where the kernel
    can (MADV_POPULATE_READ: one call instead of a fault per 4 KiB page when the engine first reads it)."""
    try:
        storage = torch.UntypedStorage.from_file(path, True, size)
    except RuntimeError as e:
        raise ShmError(f"cannot map shm segment {path!r}: {e}") from None
    # torch's stub gives from_file any storage type; it returns an UntypedStorage, which set_ takes
    t = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
    if _LIBC is not None and size:
        if _LIBC.mprotect(t.data_ptr(), size, mmap.PROT_READ) != 0:
            raise ShmError(f"cannot make the mapping of {path!r} read-only (errno {ctypes.get_errno()})")
        _LIBC.madvise(t.data_ptr(), size, _MADV_POPULATE_READ)  # best effort: older kernels answer EINVAL
    return t


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        for fn in (lib.mprotect, lib.madvise):
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_MADV_POPULATE_READ = 22


class _Segment:
    """One file of the trainer's: its mapping and the header fields stored while the data is written."""

    def __init__(self, directory: str, size: int):
        path = os.path.join(directory, f"inflight-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:  # reserve the pages now: writing past the free space of a tmpfs kills the process with SIGBUS
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                free = os.statvfs(directory)
                raise ShmError(
                    f"cannot reserve {size / 2**20:.0f} MiB in {directory} ({e.strerror}; "
                    f"{free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): give the container more shared memory "
                    "(docker --shm-size) or point trainer.shm_dir at a larger memory file system") from None
            self.mm = _map(fd, size, writable=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path, self.size = path, size
        everything = _bytes_view(self.mm)
        # each None once discarded
        self.data: torch.Tensor | None = everything[SHM_HEADER_BYTES:]
        self.state: ctypes.c_uint32 | None = ctypes.c_uint32.from_address(everything.data_ptr() + _STATE_AT)
        self.written: ctypes.c_uint64 | None = ctypes.c_uint64.from_address(everything.data_ptr() + _WRITTEN_AT)
        # a writer dropped without discard(), or an interpreter that exits, still removes the file (it is memory);
        # only a killed process leaves one behind (its pid is in the name)
        self._finalizer = weakref.finalize(self, _unlink, path)

    def discard(self) -> None:
        """Remove the file (a server still mapping it keeps its pages until it lets go)."""
        self.data, self.state, self.written = None, None, None
        try:
            self.mm.close()
        except BufferError:
            pass
        self._finalizer()  # unlinks now, once


class ShmWriter:
    """The trainer's segment: created on first use in `directory`, reused while the layout stays the same. It is
    written only once every server has answered the update before; after any failed update the file is dropped and
    never written again."""

    def __init__(self, directory: str = "/dev/shm"):
        self.directory = directory
        self._cur: _Segment | None = None
        self._data_bytes = 0

    @property
    def path(self) -> str | None:
        return self._cur.path if self._cur is not None else None

    def write(self, tensors: list[tuple[str, torch.Tensor]], dtypes: list[str], offsets: list[int],
              data_bytes: int, version: int, digest: bytes) -> dict[str, Any]:
        """The whole update at once (begin, write_tensors, finish; abandoned on an error): returns the `shm` field
        of the announcement, to be posted after it returns."""
        segment = self.begin(data_bytes, version, digest)
        try:
            self.write_tensors(tensors, dtypes, offsets)
        except BaseException:
            self.abandon()
            raise
        self.finish()
        return segment

    def begin(self, data_bytes: int, version: int, digest: bytes) -> dict[str, Any]:
        """Start an update: the header says WRITING this version with nothing written; returns the `shm` field of
        the announcement, which may be posted now (servers follow the progress) when progress_is_ordered()."""
        size = SHM_HEADER_BYTES + data_bytes
        if self._cur is not None and self._cur.size != size:
            self.discard()
        if self._cur is None:
            self._cur = _Segment(self.directory, size)
        seg, self._data_bytes = self._cur, data_bytes
        seg.mm[:8] = bytes(8)  # the magic goes first and comes back last: no reader takes a half-written header
        seg.mm[8:_HEADER.size] = pack_header(version, data_bytes, digest, WRITING)[8:]
        seg.mm[:8] = SHM_MAGIC
        return {"path": seg.path, "bytes": size}

    def write_tensors(self, tensors: list[tuple[str, torch.Tensor]], dtypes: list[str], offsets: list[int]) -> None:
        """Copy every tensor (converted to its announced dtype) to its offset, in announced (ascending) order, a
        chunk of rows at a time, raising `written` after each chunk."""
        seg = self._cur
        assert seg is not None and seg.data is not None and seg.written is not None
        data, written = seg.data, seg.written
        done = 0
        for (name, t), dt, off in zip(tensors, dtypes, offsets):
            if off < done:
                raise ShmError(f"{name}: offsets must ascend (shm_layout order)")
            dst = tensor_at(data, off, list(t.shape), TORCH_DTYPES[dt])
            rows = t.shape[0] if t.dim() else 1
            step = max(1, CHUNK_BYTES // max(1, dst.numel() * dst.element_size() // max(1, rows)))
            if t.dim() == 0 or step >= rows:
                dst.copy_(t)  # converts dtype / device
                done = off + dst.numel() * dst.element_size()
                written.value = done  # after the data: x86-64 makes it visible after it
                continue
            for r0 in range(0, rows, step):
                part = dst[r0: r0 + step]
                part.copy_(t[r0: r0 + step])
                done = part.data_ptr() - data.data_ptr() + part.numel() * part.element_size()
                written.value = done

    def finish(self) -> None:
        """The update is complete: `written` covers the data, then the state says COMPLETE."""
        seg = self._cur
        assert seg is not None and seg.written is not None and seg.state is not None
        seg.written.value = self._data_bytes
        seg.state.value = COMPLETE

    def abandon(self) -> None:
        """The update failed midway: servers following it give up at once (the caller then discards the files)."""
        if self._cur is not None and self._cur.state is not None:
            self._cur.state.value = ABANDONED

    def discard(self) -> None:
        """Remove the segment (a server still mapping it keeps its pages until it lets go)."""
        if self._cur is not None:
            self._cur.discard()
        self._cur = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
