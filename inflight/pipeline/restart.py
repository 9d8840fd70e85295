"""A dead inference server comes back without stopping the run (`pipeline.restart_servers: true`).

The launcher starts the replacement as `python -m inflight.pipeline.restart <inflight serve arguments>`: the
built-in server behind a gate that answers 503 on /health and on the generation API until the server has applied
one weight update. The actor's server pool took the server out of rotation when its connections were refused, and
its probe (GET /health) puts it back only once the gate opens, so no request ever meets stale weights. The admin
endpoints (and /metrics) pass the gate: the trainer's next weight update fails on the new server (it is in no weight
group), the trainer forms the group again with every server (`trainer/weight_sync/rejoin.py`) and retries the update; that
update opens the gate.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from inflight import backends
from inflight.engine import serve

OPEN_PATHS = ("/init_process_group", "/request_weight_update", "/check_weight_update", "/metrics")


class WeightGate:
    """ASGI middleware: 503 for everything but the admin endpoints until a weight update returned 200."""

    def __init__(self, app: Any):
        self.app = app
        self.open = False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.open:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path not in OPEN_PATHS:
            body = json.dumps({"error": {"message": "restarted server waiting for the current weights",
                                         "type": "unavailable", "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return None

        async def watch(message: dict) -> None:
            if (path == "/request_weight_update" and message["type"] == "http.response.start"
                    and message["status"] == 200):
                self.open = True
            await send(message)

        return await self.app(scope, receive, watch)


def main(argv: list[str]) -> int:
    """`inflight serve` with the gate (same arguments)."""
    parser = argparse.ArgumentParser(prog="python -m inflight.pipeline.restart")
    serve.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.engine is not None and not backends.get(args.engine).restartable:
        raise SystemExit("restart_servers supports the built-in engine only")
    app = serve.build_app(args)
    logging.getLogger("inflight.restart").warning("restarted server: waiting for the current weights")
    serve.serve_app(WeightGate(app), args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
