"""Transports from the dispatcher to inference servers.

``Backend`` is the small interface (``base.py``); ``OpenAIBackend`` speaks the OpenAI HTTP
API (``openai.py``) over a pooled HTTP/1.1 client of its own (``_http.py``); its streamed
events are ``JSONEvent`` dicts that keep the bytes they were parsed from; ``SaturationProbe``
reads a server's Prometheus metrics (``probe.py``).
"""

from __future__ import annotations

from .base import CHAT_COMPLETIONS, COMPLETIONS, ENDPOINTS, Backend, JSONEvent
from .openai import OpenAIBackend
from .probe import ProbeReading, SaturationProbe

__all__ = [
    "Backend",
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "ENDPOINTS",
    "JSONEvent",
    "OpenAIBackend",
    "ProbeReading",
    "SaturationProbe",
]
