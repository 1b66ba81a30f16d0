"""Transports from the dispatcher to inference servers.

``Backend`` is the small interface (``base.py``); ``OpenAIBackend`` speaks the OpenAI HTTP
API over aiohttp (``openai.py``); ``SaturationProbe`` reads a server's Prometheus metrics
(``probe.py``).
"""

from __future__ import annotations

from .base import CHAT_COMPLETIONS, COMPLETIONS, ENDPOINTS, Backend
from .openai import OpenAIBackend
from .probe import ProbeReading, SaturationProbe

__all__ = [
    "Backend",
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "ENDPOINTS",
    "OpenAIBackend",
    "ProbeReading",
    "SaturationProbe",
]
