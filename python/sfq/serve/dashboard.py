"""``GET /dashboard``: one self-contained HTML page (``dashboard.html``, shipped as package
data) that polls ``/stats`` and draws each pool's shares against the shares its weights
promise, its requests waiting and in flight, its waits, and its orgs and classes with their
weights (docs/gateway.md, "Seeing fairness").

The page is static: it holds no figure, no key and no name of the gateway's; everything it
shows it reads from ``/stats`` in the browser and puts on the page as text. It is sent with a
Content-Security-Policy that lets run only its own script (by its SHA-256), fetch only from
its own origin, and load nothing else: a name that slipped through as markup still could not
run a script.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources

__all__ = ["page", "headers"]

_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.S)


@lru_cache(maxsize=1)
def page() -> bytes:
    """The page's bytes (read once from the package)."""
    return resources.files(__package__).joinpath("dashboard.html").read_bytes()


@lru_cache(maxsize=1)
def headers() -> dict[str, str]:
    """The page's response headers: its type, no caching, and the policy naming its one script."""
    scripts = _SCRIPT.findall(page())
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s).digest()).decode()}'" for s in scripts)
    csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
           "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-cache",
            "Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
