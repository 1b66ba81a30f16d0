"""``sfq serve``: the fair OpenAI-compatible gateway.

A thin HTTP layer (:class:`Gateway`, on aiohttp) over :class:`sfq.dispatch.PolicyDispatcher`:
bearer key -> org, ``X-SFQ-Class`` -> class (checked), model -> pool; the policy file decides
the rest. Routes, headers, status codes and metric names: docs/gateway.md; run it
with ``sfq serve --config FILE``.
"""

from __future__ import annotations

from .app import ACCESS_LOGGER, Gateway
from .errors import REFUSALS, HTTPError, http_error_of
from .main import configure_logging, run, serve

__all__ = ["ACCESS_LOGGER", "Gateway", "HTTPError", "REFUSALS", "configure_logging", "http_error_of", "run", "serve"]
