"""Write each ```python block of a Markdown file to its own module, for mypy --strict.

usage: python .ci/readme_examples.py README.md OUTDIR   (prints the files written)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S)]


def main(argv: list[str]) -> int:
    src, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    found = blocks(src.read_text(encoding="utf-8"))
    if not found:
        print(f"no python blocks in {src}", file=sys.stderr)
        return 1
    for i, code in enumerate(found, 1):
        path = out / f"{src.stem.lower()}_example_{i}.py"
        path.write_text(code, encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
