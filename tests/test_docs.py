"""What ships cites what a reader can get: the public papers and docs/, never the design
documents the project was started from (they do not ship). And the docs it points to exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNSHIPPED = re.compile(r"seed[ _-]?0\d\d|shared/seeds", re.IGNORECASE)
SCANNED = {"python/sfq": ("*.py", "*.pyi"), "src/csfq": ("*.pyx", "*.pxd", "*.h"), "docs": ("*.md",),
           "tests": ("*.py",), "benchmarks": ("*.py", "*.md"), ".ci": ("*",), ".github": ("*.yml",)}
# files of other work in progress that still cite them; the list may only shrink
KNOWN: set[str] = set()

pytestmark = pytest.mark.skipif(not (ROOT / "python" / "sfq").is_dir(), reason="needs the source tree")


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "setup.py"]
    for folder, patterns in SCANNED.items():
        for pattern in patterns:
            out += [p for p in (ROOT / folder).rglob(pattern)
                    if p.is_file() and "build" not in p.relative_to(ROOT).parts and p.suffix != ".so"]
    return sorted(set(out))


def test_nothing_cites_the_unshipped_design_documents():
    citing = {}
    for p in _files():
        rel = p.relative_to(ROOT).as_posix()
        text = p.read_text(encoding="utf-8", errors="replace")
        hits = [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in UNSHIPPED.finditer(text)]
        if hits and rel not in KNOWN and rel != "tests/test_docs.py":
            citing[rel] = hits
    assert not citing, "cite docs/ or the public papers instead:\n" + "\n".join(h for v in citing.values() for h in v)


def test_the_cited_docs_exist():
    for doc in ("docs/design.md", "docs/simulator.md", "docs/API.md"):
        assert (ROOT / doc).is_file(), doc
    sections = re.findall(r"docs/(design|simulator)\.md §(\d+(?:\.\d+)?)", "\n".join(
        p.read_text(encoding="utf-8", errors="replace") for p in _files()))
    for doc, sec in set(sections):
        text = (ROOT / "docs" / f"{doc}.md").read_text(encoding="utf-8")
        assert re.search(rf"^#+ {re.escape(sec)}\.? ", text, flags=re.M), f"docs/{doc}.md has no section {sec}"
