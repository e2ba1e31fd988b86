"""``memfit exporter``: serve per-device memory as Prometheus metrics until interrupted."""

from __future__ import annotations

import time

from memfit.errors import UserError
from memfit.telemetry.prometheus import listen_error, metrics_url, serve_exporter


def run(ns) -> int:
    if not 0 <= ns.port <= 65535:
        raise UserError(f"--port must be in 0..65535 (got {ns.port}); 0 picks a free port")
    if not ns.host.strip():
        raise UserError("--host is empty: give an address of this machine, 127.0.0.1 (the default) or 0.0.0.0 for all")
    try:
        server, backend = serve_exporter(ns.port, ns.host)
    except OSError as e:
        raise UserError(listen_error(e, ns.host, ns.port, "--host", "--port")) from None
    print(f"memfit exporter: device memory from {backend} at {metrics_url(ns.host, server.server_port)}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
