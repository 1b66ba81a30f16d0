"""Saturation probe: reads an inference server's Prometheus ``/metrics`` and says whether it
is saturated, so the dispatcher holds requests in sfq (where the order is fair) instead of
in the engine's own queue (where it is FIFO).

Known gauges (summed over label sets; the KV usage takes the maximum):

=========  ===============================  ===========================  ==================
           llama.cpp ``llama-server``       vLLM                         SGLang
=========  ===============================  ===========================  ==================
waiting    ``llamacpp:requests_deferred``   ``vllm:num_requests_waiting``  ``sglang:num_queue_reqs``
running    ``llamacpp:requests_processing`` ``vllm:num_requests_running``  ``sglang:num_running_reqs``
KV usage   (none)                           ``vllm:kv_cache_usage_perc``   ``sglang:token_usage``
                                            (older: ``gpu_cache_usage_perc``)
=========  ===============================  ===========================  ==================

A server is saturated when more than ``max_waiting`` requests wait in its own queue, or its
KV-cache usage (a fraction, 0..1) is at least ``max_kv_usage``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["SaturationProbe", "ProbeReading", "WAITING_METRICS", "RUNNING_METRICS", "KV_USAGE_METRICS"]

WAITING_METRICS = ("llamacpp:requests_deferred", "vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING_METRICS = ("llamacpp:requests_processing", "vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


class ProbeReading(NamedTuple):
    """One reading of a server's metrics. ``None`` where the server exports no such gauge."""

    waiting: float | None  # requests queued inside the engine
    running: float | None  # requests the engine is processing
    kv_usage: float | None  # KV-cache usage, a fraction 0..1
    saturated: bool
    reason: str | None  # why saturated, for stats and logs


class SaturationProbe:
    """Configuration of a saturation probe (stateless: the dispatcher keeps the readings).

    Parameters
    ----------
    interval:
        seconds between two reads of ``/metrics`` (> 0).
    max_waiting:
        the server is saturated when more than this many requests wait in its queue (>= 0).
    max_kv_usage:
        ... or when its KV-cache usage (0..1) is at least this (0 < x <= 1; > 1 disables).
    waiting_metrics, running_metrics, kv_usage_metrics:
        sample names to read, for servers not listed above.
    """

    def __init__(
        self,
        *,
        interval: float = 0.5,
        max_waiting: float = 0,
        max_kv_usage: float = 0.95,
        waiting_metrics: Iterable[str] = WAITING_METRICS,
        running_metrics: Iterable[str] = RUNNING_METRICS,
        kv_usage_metrics: Iterable[str] = KV_USAGE_METRICS,
    ) -> None:
        for name, v, zero_ok in (("interval", interval, False), ("max_waiting", max_waiting, True),
                                 ("max_kv_usage", max_kv_usage, False)):
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                    or (v == 0 and not zero_ok)):
                raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, got {v!r}")
        self.interval = float(interval)
        self.max_waiting = float(max_waiting)
        self.max_kv_usage = float(max_kv_usage)
        self.waiting_metrics = frozenset(waiting_metrics)
        self.running_metrics = frozenset(running_metrics)
        self.kv_usage_metrics = frozenset(kv_usage_metrics)

    def read(self, text: str) -> ProbeReading:
        """Parse a Prometheus text exposition. Raises ``ValueError`` when it is not one."""
        waiting = running = kv = None
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name, value = s.name, s.value
                if value != value:  # NaN: no information
                    continue
                if name in self.waiting_metrics:
                    waiting = value if waiting is None else waiting + value
                elif name in self.running_metrics:
                    running = value if running is None else running + value
                elif name in self.kv_usage_metrics:
                    kv = value if kv is None else max(kv, value)
        reason = None
        if waiting is not None and waiting > self.max_waiting:
            reason = f"{waiting:g} requests waiting in the server (> {self.max_waiting:g})"
        elif kv is not None and kv >= self.max_kv_usage:
            reason = f"KV-cache usage {kv:.3f} >= {self.max_kv_usage:g}"
        return ProbeReading(waiting, running, kv, reason is not None, reason)

    def __repr__(self) -> str:
        return (f"SaturationProbe(interval={self.interval!r}, max_waiting={self.max_waiting!r}, "
                f"max_kv_usage={self.max_kv_usage!r})")
