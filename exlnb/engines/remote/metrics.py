"""A server's own view of its load, read from its Prometheus `/metrics` with prometheus_client's text parser.

Each server names the same three numbers its own way; `METRIC_NAMES` holds them (vLLM's gauges as of 0.11,
SGLang's, llama.cpp's `--metrics`). A server without `/metrics` (TabbyAPI, llama-cpp-python, `transformers serve`)
gives None, and the server view says so instead of showing zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from exlnb.engines.remote.client import ServerAddress, get_text

# what exlnb shows -> each server's gauge for it (first found wins)
METRIC_NAMES = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred"),
    "kv_cache_usage": (
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ),
}


@dataclass(frozen=True)
class ServerMetrics:
    """The server's requests running and waiting and its KV-cache use (0..1); None where it reports no such gauge."""

    running: float | None
    waiting: float | None
    kv_cache_usage: float | None

    def line(self) -> str:
        def show(value: float | None, fmt: str) -> str:
            return "not reported" if value is None else format(value, fmt)

        return (
            f"server: {show(self.running, '.0f')} running, {show(self.waiting, '.0f')} waiting, "
            f"KV cache {show(None if self.kv_cache_usage is None else 100 * self.kv_cache_usage, '.0f')}%"
        )


def parse_metrics(text: str) -> ServerMetrics:
    """The gauges exlnb shows, summed over their label sets (one per model or engine)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    values = {key: next((found[n] for n in names if n in found), None) for key, names in METRIC_NAMES.items()}
    return ServerMetrics(**values)


def read_metrics(address: ServerAddress) -> ServerMetrics | None:
    """The server's gauges now, or None where it has no /metrics page (or one without any of them)."""
    text = get_text(address, "/metrics")
    if text is None:
        return None
    try:
        metrics = parse_metrics(text)
    except ValueError:
        return None
    return None if metrics == ServerMetrics(None, None, None) else metrics
