"""Scrape a Prometheus endpoint the way Prometheus does (its own text parser)."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, list]:
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(body)}
