"""Server side of the `cuda_ipc` transport (inflight/transport/cuda_ipc.py): check an announced buffer handle, open it once,
and hand the weight receiver views of the announced tensors in the trainer's buffer on this server's device.

Refused before anything changes (docs/inference-contract.md, "Same-device updates"): a handle from another device
or host, malformed handle fields, a buffer whose size is not the announced layout's, a header that does not say
the announced version of the announced tensors (400), and a version older than the one served (409: stale).
The version the server holds already is answered 200 with `applied: false` and nothing copied: a version names
one set of weights, and a trainer retries an update that some servers applied and others did not. The NaN/Inf
check then runs on the device, on the trainer's bytes, before the pause copies them in.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from typing import Any

import torch
from fastapi import HTTPException, Request

from inflight.transport.schemas import WeightUpdateRequest

from inflight.transport.layout import shm_layout
from inflight.transport.cuda_ipc import IpcError, check_handle, check_header, open_buffer, views
from inflight.transport.shm import announcement_digest

log = logging.getLogger("inflight.engine.weights")
LOCAL_ONLY = {"127.0.0.1", "::1", "localhost", "testclient"}  # server.LOCAL_HOSTS (server.py imports this module)


class IpcReceiver:
    """The trainer's buffer, opened once while the trainer keeps it (the same handle fields)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._key: str | None = None
        self._buf: torch.Tensor | None = None

    def validate(self, req: WeightUpdateRequest, served_version: int) -> None:
        """Everything that can be checked without opening the handle (IpcError)."""
        assert req.ipc is not None and req.params is not None
        if req.version < served_version and not req.new_run:  # token_versions never decrease (update_checks)
            raise IpcError(f"stale version: the update announces v{req.version}, this server holds "
                           f"v{served_version}; an ipc update may not go back", status=409)
        _, data_bytes = shm_layout(req.params)
        check_handle(req.ipc, data_bytes, self.device)

    def tensors(self, req: WeightUpdateRequest, served_version: int) -> dict[str, torch.Tensor]:
        """{name: view of the trainer's buffer}, after validate() and a check of the buffer's header."""
        self.validate(req, served_version)
        assert req.ipc is not None and req.params is not None
        offsets, data_bytes = shm_layout(req.params)
        key = self._key_of(req)
        if key != self._key:
            self._key, self._buf = None, None  # the trainer replaced its buffer: let the old one go
            self._buf = open_buffer(req.ipc)
            self._key = key
            log.info("opened the trainer's %s ipc buffer (%.1f MB)", req.ipc.kind, req.ipc.bytes / 1e6)
        assert self._buf is not None
        check_header(self._buf, req.version, data_bytes, announcement_digest(req.params))
        return views(self._buf, [(p.name, p.shape, p.dtype, off) for p, off in zip(req.params, offsets)])

    def _key_of(self, req: WeightUpdateRequest) -> str:
        assert req.ipc is not None
        fields: dict[str, Any] = req.ipc.model_dump()
        if req.ipc.kind == "cpu" and req.ipc.path:  # a new file under the same name is a new buffer
            st = os.stat(req.ipc.path)
            if not stat.S_ISREG(st.st_mode):
                raise IpcError(f"ipc buffer {req.ipc.path!r} is not a regular file")
            fields["inode"] = (st.st_dev, st.st_ino)
        return json.dumps(fields, sort_keys=True)

    def done(self) -> None:
        """The copies out of the trainer's buffer have finished: after the answer the trainer may write it again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._key, self._buf = None, None


async def ipc_local_only(request: Request) -> None:
    """An update that hands this server a buffer handle comes from this host only, whatever --allow-remote-admin
    says: a handle is meaningful on one machine."""
    if request.url.path not in ("/request_weight_update", "/check_weight_update"):
        return
    try:
        body = await request.json()
    except Exception:
        return  # the route's own validation answers
    host = request.client.host if request.client else ""
    if isinstance(body, dict) and body.get("ipc") is not None and host not in LOCAL_ONLY:
        log.warning("403 %s with an ipc buffer from %s", request.url.path, host)
        raise HTTPException(403, "ipc weight updates are accepted from this host only")
