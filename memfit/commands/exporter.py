"""``memfit exporter``: serve per-device memory as Prometheus metrics until interrupted."""

from __future__ import annotations

import time

from memfit.errors import UserError
from memfit.telemetry.prometheus import listen_error, serve_exporter


def run(ns) -> int:
    if not 0 <= ns.port <= 65535:
        raise UserError(f"--port must be in 0..65535 (got {ns.port}); 0 picks a free port")
    try:
        server, backend = serve_exporter(ns.port, ns.host)
    except OSError as e:
        raise UserError(listen_error(e, ns.host, ns.port, "--host", "--port")) from None
    print(f"memfit exporter: device memory from {backend} at http://{ns.host}:{server.server_port}/metrics", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
