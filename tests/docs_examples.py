"""The examples of the shipped docs (README.md, docs/*.md, benchmarks/README.md), found and run.

A fenced block is an example by its language:

* ``python``: run as a file, in a sandbox directory (below), with a timeout;
* ``yaml``: a policy file (a block with ``pools:``) or a section of the last policy before it
  in the same document: validated with :func:`sfq.parse_policy`;
* ``sh`` / ``bash``: each command, by what it is (:func:`check_command`): run in the sandbox
  (``curl``, ``sfq check-config``), validated where running it takes minutes or never ends
  (``sfq simulate`` and ``sfq serve`` through the command's own parser; a script through its
  ``--help``, every option used checked there; ``pip install`` against pyproject's extras);
* ``jsonl``: a simulator trace, read by :func:`sfq.sim.model.read_trace_lines`;
* ``promql``: every ``sfq_*`` series it names is one the policy layer exports;
* ``text`` and unlabelled blocks are output or diagrams, not examples.

HTML comments right above a block mark it: ``<!-- quickstart -->`` blocks are the README's
gateway quick start, run together as written by their own test; a ``<!-- run-by: TEST -->``
block (a server that never ends, with what a reader sends it) is run as written by the test
file it names, and only checked here; ``<!-- expect: CODE -->`` above a shell block: it shows
a refusal, and every error it prints has that code (a budget's ``budget_exhausted``). A table
under ``<!-- from: COMMAND -->`` is output of that deterministic command, row for row.

The sandbox is a temporary directory holding ``policy.yaml`` (the last policy block before the
example in its document, else ``docs/demo-policy.yaml``), the checkout's ``docs`` and
``examples`` (their policy files copied, the rest linked) and links to its ``benchmarks`` and
``tests``. An example that
talks to ``127.0.0.1:8001`` (or reads ``policy.yaml``) gets the demo engine there, started as
the docs tell a reader to start it: ``sfq demo-backend`` with its defaults (:data:`DEMO_MODEL`,
port 8001), never told the model an example asks for, so an example naming a model the engine
does not serve fails as it would for a reader (404). One that talks to ``localhost:8080`` also
gets ``sfq serve`` with ``policy.yaml`` there.
Where the machine allows it (``unshare -n``, as root) everything runs in a network namespace of
its own, so the docs' fixed ports are used as written and cannot collide with anything else;
elsewhere (or with ``SFQ_DOCS_NO_NETNS=1``) the two ports are replaced with free ones.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
DEMO_POLICY = ROOT / "docs" / "demo-policy.yaml"
ENGINE_PORT, GATEWAY_PORT = 8001, 8080

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"^<!--\s*(.*?)\s*-->$")
_PORTS = re.compile(r"(?<=[:\s])(8001|8080)\b")
_NEEDS_SERVERS = re.compile(r"(127\.0\.0\.1|localhost):(8001|8080)\b")
_NEEDS_GATEWAY = re.compile(r"(127\.0\.0\.1|localhost):8080\b")


def _demo_default(option: str) -> str:
    """The default of ``sfq demo-backend --OPTION``: what its own parser gives a bare command."""
    from sfq.cli import build_parser

    return str(getattr(build_parser().parse_args(["demo-backend"]), option))


#: the one model ``sfq demo-backend`` serves when started with its defaults, as the docs start it
DEMO_MODEL = _demo_default("model")

# brings the loopback interface of a fresh network namespace up (SIOCGIFFLAGS / SIOCSIFFLAGS)
_LO_UP = ("import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
          "f = struct.unpack('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH', b'lo', 0))[:18])[1]; "
          "fcntl.ioctl(s, 0x8914, struct.pack('16sH', b'lo', f | 1))")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    text: str
    marks: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT).as_posix()}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text(encoding="utf-8")
    out: list[Block] = []
    for m in _FENCE.finditer(text):
        above = text[:m.start()].rstrip("\n").split("\n")
        marks: list[str] = []
        while above and (mk := _MARK.match(above[-1].strip())):
            marks.insert(0, mk.group(1))
            above.pop()
        out.append(Block(doc, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2), tuple(marks)))
    return out


def run_by(block: Block) -> str | None:
    """The test file a ``<!-- run-by: TEST -->`` block names (it runs the block as written)."""
    return next((m.split(":", 1)[1].strip() for m in block.marks if m.startswith("run-by:")), None)


def marked_run_by(test_file: str) -> list[Block]:
    """The blocks of the shipped docs that ``test_file`` (``tests/NAME.py``) is to run."""
    return [b for b in all_blocks() if run_by(b) == test_file]


def all_blocks() -> list[Block]:
    return [b for d in DOCS for b in blocks(d)]


def from_tables(doc: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, command, table lines)`` for every table under a ``<!-- from: COMMAND -->`` mark."""
    text = doc.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^<!--\s*from:\s*(.*?)\s*-->\n((?:\|.*\n)+)", text, re.M):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2).rstrip("\n").split("\n")))
    return out


def is_policy(text: str) -> bool:
    return re.search(r"^pools:", text, re.M) is not None


def policy_before(block: Block) -> str:
    """The last complete policy block before ``block`` in its document, else the demo policy."""
    found = DEMO_POLICY.read_text(encoding="utf-8")
    for b in blocks(block.doc):
        if b.line >= block.line:
            break
        if b.lang == "yaml" and is_policy(b.text):
            found = b.text
    return found


def needs(text: str) -> tuple[bool, bool]:
    """Whether an example needs the demo engine, and whether it needs the gateway too."""
    gateway = _NEEDS_GATEWAY.search(text) is not None
    return gateway or _NEEDS_SERVERS.search(text) is not None or "policy.yaml" in text, gateway


def commands(text: str) -> list[str]:
    """The block's command lines, continuations joined."""
    out: list[str] = []
    cur = ""
    for line in text.split("\n"):
        cur += line
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def words(cmd: str) -> list[str]:
    """The command's words, comments and leading ``NAME=value`` assignments dropped."""
    w = shlex.split(cmd, comments=True)
    while w and re.match(r"^[A-Z_][A-Z0-9_]*=", w[0]):
        w.pop(0)
    return w


def _netns() -> bool:
    if os.environ.get("SFQ_DOCS_NO_NETNS") or not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-n", sys.executable, "-c", _LO_UP], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NETNS = _netns()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Sandbox:
    """A directory to run examples in (see the module docstring)."""

    def __init__(self, path: Path, policy_text: str | None = None) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.ports = ({ENGINE_PORT: ENGINE_PORT, GATEWAY_PORT: GATEWAY_PORT} if NETNS else
                      {ENGINE_PORT: _free_port(), GATEWAY_PORT: _free_port()})
        for name in ("benchmarks", "tests"):
            if not (path / name).exists():
                (path / name).symlink_to(ROOT / name)
        for name in ("docs", "examples"):  # their policy files with this sandbox's ports
            (path / name).mkdir(exist_ok=True)
            for f in (ROOT / name).iterdir():
                if f.suffix == ".yaml":
                    (path / name / f.name).write_text(self.ports_in(f.read_text(encoding="utf-8")), encoding="utf-8")
                elif not (path / name / f.name).exists():
                    (path / name / f.name).symlink_to(f)
        self.policy_text = policy_text if policy_text is not None else DEMO_POLICY.read_text(encoding="utf-8")
        (path / "policy.yaml").write_text(self.ports_in(self.policy_text), encoding="utf-8")
        # `python` is this interpreter, and `sfq` the one under test: this checkout's python/
        # (through PYTHONPATH) when that is what the tests import, else the installed command
        import sfq

        src = Path(sfq.__file__).resolve().parent.parent
        shims = path / ".bin"
        shims.mkdir(exist_ok=True)
        (shims / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (shims / "python").chmod(0o755)
        self.env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ.get('PATH', '')}", MPLBACKEND="Agg")
        if src == ROOT / "python" or shutil.which("sfq") is None:
            (shims / "sfq").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m sfq "$@"\n')
            (shims / "sfq").chmod(0o755)
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))

    @staticmethod
    def plain_env() -> dict[str, str]:
        """The environment for running ``python -m sfq`` (or a script) on the sfq under test."""
        import sfq

        src = Path(sfq.__file__).resolve().parent.parent
        env = dict(os.environ, MPLBACKEND="Agg")
        if src == ROOT / "python":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
        return env

    def ports_in(self, text: str) -> str:
        """``text`` with the docs' ports replaced by this sandbox's (the same ones in a namespace)."""
        return _PORTS.sub(lambda m: str(self.ports[int(m.group(1))]), text)

    def servers(self, gateway: bool = True) -> str:
        """Shell lines that start the demo engine with its defaults (in a namespace of our own
        the port is its default too), and the gateway unless told not to, and wait until they
        answer."""
        e, g = self.ports[ENGINE_PORT], self.ports[GATEWAY_PORT]
        engine = "sfq demo-backend" if e == ENGINE_PORT else f"sfq demo-backend --port {e}"
        up = f"curl -sf -o /dev/null localhost:{e}/health"
        lines = f"{engine} > demo.log 2>&1 &\n"
        if gateway:
            lines += f"sfq serve --config policy.yaml --port {g} --access-log off > gateway.log 2>&1 &\n"
            up = f"curl -s -o /dev/null localhost:{g}/health && {up}"
        return lines + textwrap.dedent(f"""\
            for _ in $(seq 300); do
                {up} && break
                sleep 0.1
            done
            """)

    def run(self, script: str, *, servers: bool = False, gateway: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run a bash script here (in a network namespace of its own where possible); every
        background job it or :meth:`servers` started is stopped when it ends. ``servers``: start
        the demo engine first (and the gateway, unless ``gateway`` is false)."""
        body = "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n"
        if servers:
            body += self.servers(gateway)
        body += script + "\n"
        (self.path / "example.sh").write_text(body, encoding="utf-8")
        cmd = (["unshare", "-n", "bash", "-c", f'"{sys.executable}" -c "{_LO_UP}" && exec bash example.sh']
               if NETNS else ["bash", "example.sh"])
        proc = subprocess.Popen(cmd, cwd=self.path, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"timed out after {timeout:g} s:\n{body}\n--- output:\n{out[-4000:]}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything the script left behind
            except ProcessLookupError:
                pass
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
