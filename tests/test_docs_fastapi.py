"""The docs' FastAPI examples, run as written against a real ``sfq demo-backend`` at its
defaults (in the docs examples' sandbox, ``tests/docs_examples.py``): docs/API.md's app, saved as
``app.py`` and served by ``python app.py``, answers a reply and a stream, passes the demo
engine's own 400 on as that 400 in its words, and answers 400 for a body that is not JSON or
not an object; docs/library.md's block starts examples/fastapi_proxy.py under its shipped
policy and gets a reply through it. Nothing is timed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from docs_examples import ROOT, Block, Sandbox, commands, marked_run_by, words

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.skipif(not (ROOT / "docs").is_dir() or not (ROOT / "examples").is_dir(),
                                reason="needs the source tree (docs/, examples/)")

BLOCKS = marked_run_by("tests/test_docs_fastapi.py") if (ROOT / "docs").is_dir() else []
APP_PORT = 8000  # the app's port in docs/API.md
CHAT = '{"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": %s}'
STREAM = '{"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "stream": true}'


def _block(doc: str, lang: str) -> Block:
    found = [b for b in BLOCKS if b.doc.name == doc and b.lang == lang]
    assert len(found) == 1, f"{doc}: one {lang} block marked run-by: tests/test_docs_fastapi.py, found {len(found)}"
    return found[0]


def _post(port: int, body: str, name: str) -> str:
    """A shell line posting ``body`` to the app, printing ``name``, the status and the reply."""
    return (f"printf '%s ' {name}; curl -s -w ' %{{http_code}}\\n' localhost:{port}/v1/chat/completions "
            f"-H 'Content-Type: application/json' --data-binary '{body}'")


def _replies(out: str) -> dict[str, tuple[dict | list | None, int]]:
    """``name -> (reply, status)`` from the lines :func:`_post` printed."""
    got = {}
    for m in re.finditer(r"^(\w+) (.*) (\d{3})$", out, re.M):
        try:
            doc = json.loads(m.group(2))
        except ValueError:
            doc = None
        got[m.group(1)] = (doc, int(m.group(3)))
    return got


def test_api_md_fastapi_app_runs_as_written(tmp_path: Path):
    block = _block("API.md", "python")
    sb = Sandbox(tmp_path)
    port = sb.ports[8080]  # a port of the sandbox's own (in a network namespace: 8080)
    assert f"port={APP_PORT})" in block.text
    (tmp_path / "app.py").write_text(block.text.replace(f"port={APP_PORT})", f"port={port})"), encoding="utf-8")
    wait = (f"curl -s -o /dev/null --retry 30 --retry-connrefused --retry-delay 1 localhost:{port}/docs "
            "|| { echo 'the app did not start'; cat app.log; exit 1; }")
    script = "\n".join([
        "python app.py > app.log 2>&1 &", wait,
        _post(port, CHAT % 8, "reply"),
        _post(port, CHAT % 5000, "upstream400"),  # over the demo engine's max_tokens_limit (4096)
        _post(port, "{not json", "notjson"),
        _post(port, "[1, 2]", "notobject"),
        f"printf 'stream '; curl -sN localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' "
        f"--data-binary '{STREAM}' | grep -c '^data: '",  # each event a data: line
        "cat app.log"])
    res = sb.run(script, servers=True, gateway=False, timeout=120)
    out = res.stdout
    assert res.returncode == 0, out[-4000:]
    got = _replies(out)
    reply, status = got["reply"]
    assert status == 200 and isinstance(reply, dict) and reply["object"] == "chat.completion", out[-3000:]
    assert reply["usage"]["completion_tokens"] == 8
    err, status = got["upstream400"]  # the demo engine's own 400, in its words
    assert status == 400 and isinstance(err, dict), out[-3000:]
    assert err["error"]["message"] == "max_tokens must be at most 4096, got 5000"
    assert err["error"]["code"] == "invalid_max_tokens"
    for name in ("notjson", "notobject"):
        err, status = got[name]
        assert status == 400 and isinstance(err, dict) and err["error"]["code"] == "bad_request", (name, out[-3000:])
    events = re.search(r"^stream (\d+)$", out, re.M)
    assert events is not None and int(events.group(1)) >= 4, out[-3000:]  # 3 tokens and [DONE], at least
    assert "Traceback" not in out, out[-4000:]


def test_library_md_runs_the_fastapi_example_proxy_under_its_policy(tmp_path: Path):
    """The block as written (the install line is this environment's own): the demo engine, the
    example proxy with examples/fastapi_policy.yaml, a request of the user key-acme."""
    block = _block("library.md", "sh")
    sb = Sandbox(tmp_path)
    script = [sb.ports_in(c) for c in commands(block.text) if words(c)[:2] != ["pip", "install"]]
    assert any("examples/fastapi_policy.yaml" in c for c in script)
    res = sb.run("\n".join(script), timeout=120)
    out = res.stdout
    assert res.returncode == 0 and "Traceback" not in out, out[-4000:]
    reply = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 8, out[-3000:]
