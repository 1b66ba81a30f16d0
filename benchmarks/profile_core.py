"""Where the time of a steady-state pair goes: instruction and cache-miss counts per pair,
measured with valgrind's callgrind (simulated caches), by object file and by function.

    python benchmarks/profile_core.py                     # T = 10k: compiled, batch, minimal, floor
    python benchmarks/profile_core.py --T 100000 --impls compiled
    python benchmarks/profile_core.py --lines             # also the core's source lines that miss most
    python benchmarks/profile_core.py --run compiled --T 10000 --pairs 5000   # the workload alone

Method: each implementation runs the steady workload of ``bench_core.py`` (the same state, the
same seeded draws) twice under ``valgrind --tool=callgrind --cache-sim=yes``, once with
``--pairs`` pairs after the warm-up and once with ``2 * --pairs``; the difference of the two
profiles, divided by ``--pairs``, is the cost of one pair, with start-up, imports, building
and warming up cancelled out. Events: Ir (instructions), D1mr/D1mw (loads/stores that miss
the first-level data cache), DLmr/DLmw (loads/stores that miss the last level). Callgrind's
caches are a model (two levels, sizes of this machine's L1 and LL), not the real hierarchy:
read them as "which loads leave L1", not as nanoseconds. Counts are deterministic, so this
works on a busy machine where wall-clock times do not.

Object files are grouped as: the interpreter (the python binary and libpython), the compiled
core (sfq's _csfq extension), the C floor (cfloor), libc / libm, and other.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

EVENTS = ("Ir", "D1mr", "D1mw", "DLmr", "DLmw")
IMPLS = ("compiled", "batch", "minimal", "floor")


# --------------------------------------------------------------------------- the workload
def run_workload(impl: str, T: int, pairs: int) -> None:
    """Build the steady state of bench_core.py at T, warm it up, then run `pairs` pairs."""
    import numpy as np

    import bench_core as bc

    # the inputs of `2 * pairs` pairs are drawn whatever `pairs` is, so that drawing them
    # cancels out of the difference of two runs; only the first `pairs` are used
    if impl in ("compiled", "batch"):
        rng = bc.rng_for("steady" if impl == "compiled" else "batch", T)
        s = bc.build_backlogged("compiled", T, rng)
        bc.steady_pairs(s, bc.costs(rng, max(T, 1000)))
        if impl == "compiled":
            bc.steady_pairs(s, bc.costs(rng, 2 * pairs)[:pairs])
        else:
            n = max(1, min(1024, T // 4))
            blocks = [rng.integers(1, bc.MAX_COST + 1, n).astype(np.float64) for _ in range(max(1, 2 * pairs // n))]
            bc.batch_pairs(s, n, blocks[: max(1, pairs // n)])
    elif impl == "minimal":
        m, rng = bc.build_minimal(T)
        bc.minimal_pairs(m, bc.costs(rng, 2 * pairs)[:pairs])
    elif impl == "floor":
        from floor_build import load_cfloor

        fl, rng = bc.build_floor(load_cfloor(), T)
        fl.steady(np.asarray(bc.costs(rng, 2 * pairs))[:pairs])
    else:
        raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")


# --------------------------------------------------------------------------- callgrind
def group_of(obj: str) -> str:
    name = os.path.basename(obj)
    if name.startswith("_csfq"):
        return "core (_csfq)"
    if name.startswith("cfloor"):
        return "C floor (cfloor)"
    if name.startswith("python") or name.startswith("libpython"):
        return "interpreter (CPython)"
    if name.startswith("libc.") or name.startswith("libc-") or name.startswith("libm."):
        return "libc / libm"
    if name.startswith("_multiarray") or name.startswith("libopenblas") or name.startswith("libscipy"):
        return "numpy"
    return "other"


_PERC = re.compile(r"\(\s*[\d.]+%\)")  # callgrind_annotate's percentage columns
# callgrind's last level, modelled as this kind of machine's per-core L2 (512 KiB, 8-way): a
# "DL" miss is a load or store that has to go to L3 or memory
LL_MODEL = "--LL=524288,8,64"


def annotate(outfile: Path, inclusive: bool = False) -> dict[str, list[int]]:
    """{'file:function [object]': [Ir, D1mr, D1mw, DLmr, DLmw]} (self cost) from callgrind_annotate."""
    cmd = ["callgrind_annotate", "--threshold=100", "--show=" + ",".join(EVENTS), "--sort=Ir", "--auto=no",
           f"--inclusive={'yes' if inclusive else 'no'}", str(outfile)]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows: dict[str, list[int]] = {}
    started = False
    for line in text.splitlines():
        if not started:
            if re.search(r"file:function", line):
                started = True
            continue
        if line.startswith("----") or line.startswith("-- "):  # the end of the function list
            if rows:
                break
            continue
        parts = _PERC.sub(" ", line).split()
        nums: list[int] = []
        i = 0
        while i < len(parts) and len(nums) < len(EVENTS):
            tok = parts[i]
            if re.fullmatch(r"[\d,]+", tok):
                nums.append(int(tok.replace(",", "")))
                i += 1
            elif tok == ".":
                nums.append(0)
                i += 1
            else:
                break
        if len(nums) != len(EVENTS) or i >= len(parts):
            continue
        rows[" ".join(parts[i:])] = nums
    return rows


def callgrind(impl: str, T: int, pairs: int, workdir: Path, extra: list[str]) -> Path:
    out = workdir / f"callgrind.{impl}.{T}.{pairs}.out"
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", LL_MODEL, f"--callgrind-out-file={out}", *extra,
           sys.executable, str(Path(__file__).resolve()), "--run", impl, "--T", str(T), "--pairs", str(pairs)]
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"profile_core.py: valgrind failed on {impl} (exit status {res.returncode})")
    return out


def per_pair(a: Path, b: Path, pairs: int) -> dict[str, list[float]]:
    ra, rb = annotate(a), annotate(b)
    out: dict[str, list[float]] = {}
    for k in set(ra) | set(rb):
        x, y = ra.get(k, [0] * len(EVENTS)), rb.get(k, [0] * len(EVENTS))
        d = [(yy - xx) / pairs for xx, yy in zip(x, y)]
        if any(abs(v) >= 0.05 for v in d):
            out[k] = d
    return out


def object_of(key: str) -> str:
    m = re.search(r"\[([^\]]+)\]\s*$", key)
    return m.group(1) if m else "?"


def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 10 else f"{v:.1f}"


def report(impl: str, T: int, rows: dict[str, list[float]], top: int) -> str:
    L = [f"### {impl}, T = {T:,}: per pair", ""]
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(EVENTS))
    for k, v in rows.items():
        g = groups[group_of(object_of(k))]
        for i, x in enumerate(v):
            g[i] += x
    total = [sum(g[i] for g in groups.values()) for i in range(len(EVENTS))]
    L.append("| where | " + " | ".join(EVENTS) + " |")
    L.append("|---|" + "---:|" * len(EVENTS))
    for name, v in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        L.append(f"| {name} | " + " | ".join(fmt(x) for x in v) + " |")
    L.append("| **total** | " + " | ".join(f"**{fmt(x)}**" for x in total) + " |")
    L.append("")
    L.append(f"Top functions (self cost, per pair):")
    L.append("")
    L.append("| function | object | " + " | ".join(EVENTS) + " |")
    L.append("|---|---|" + "---:|" * len(EVENTS))
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        fn = re.sub(r"\s*\[[^\]]+\]\s*$", "", k).split(":")[-1]
        L.append(f"| `{fn}` | {os.path.basename(object_of(k))} | " + " | ".join(fmt(x) for x in v) + " |")
    L.append("")
    return "\n".join(L)


def line_misses(a: Path, b: Path, pairs: int, source_hint: str, top: int) -> str:
    """The source lines of files matching source_hint with the most D1 read misses per pair."""
    def lines(p: Path) -> dict[tuple[str, int], list[int]]:
        cmd = ["callgrind_annotate", "--threshold=100", "--show=" + ",".join(EVENTS), "--auto=yes",
               "--context=0", str(p)]
        text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        out: dict[tuple[str, int], list[int]] = {}
        cur, lineno = None, 0
        for line in text.splitlines():
            m = re.match(r"^-- (?:Auto-annotated source|User-annotated source): (.*)$", line)
            if m:
                cur = m.group(1).strip()
                continue
            if cur is None or source_hint not in cur:
                continue
            m = re.match(r"^-- line (\d+) ", line)
            if m:
                lineno = int(m.group(1)) - 1
                continue
            toks = line.split()
            nums = []
            for t in toks[: len(EVENTS)]:
                if re.fullmatch(r"[\d,]+", t):
                    nums.append(int(t.replace(",", "")))
                elif t == ".":
                    nums.append(0)
                else:
                    break
            if len(nums) == len(EVENTS):
                lineno += 1
                src = line.split(None, len(EVENTS))[-1] if len(toks) > len(EVENTS) else ""
                out[(cur, lineno)] = nums
                out[(cur, lineno)].append(src)  # type: ignore[arg-type]
        return out

    la, lb = lines(a), lines(b)
    diff = []
    for k in set(la) | set(lb):
        x, y = la.get(k, [0] * len(EVENTS) + [""]), lb.get(k, [0] * len(EVENTS) + [""])
        d = [(y[i] - x[i]) / pairs for i in range(len(EVENTS))]
        diff.append((d, k, (y[-1] or x[-1])))
    diff.sort(key=lambda t: -(t[0][1] + t[0][2]))
    L = [f"Source lines with the most D1 misses per pair ({source_hint}):", "",
         "| line | source | " + " | ".join(EVENTS) + " |", "|---|---|" + "---:|" * len(EVENTS)]
    for d, (f, n), src in diff[:top]:
        if d[1] + d[2] < 0.01:
            break
        src = str(src).strip().replace("|", "\\|")[:70]
        L.append(f"| {os.path.basename(f)}:{n} | `{src}` | " + " | ".join(fmt(x) for x in d) + " |")
    L.append("")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Instruction and cache-miss counts per steady-state pair (callgrind).")
    ap.add_argument("--T", type=int, default=10_000, help="flows (default 10,000)")
    ap.add_argument("--pairs", type=int, default=20_000, help="pairs in the shorter of the two runs")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {','.join(IMPLS)}")
    ap.add_argument("--top", type=int, default=12, help="functions (and lines) to list")
    ap.add_argument("--lines", action="store_true", help="also list the core's source lines that miss D1 most")
    ap.add_argument("--keep", type=Path, default=None, help="keep the callgrind.out files in this folder")
    ap.add_argument("--run", metavar="IMPL", help=argparse.SUPPRESS)  # the workload itself (under valgrind)
    a = ap.parse_args(argv)
    if a.T < 1 or a.pairs < 1:
        ap.error(f"--T and --pairs must be >= 1, got {a.T} and {a.pairs}")
    if a.run:
        run_workload(a.run, a.T, a.pairs)
        return 0
    impls = [x for x in a.impls.split(",") if x]
    for x in impls:
        if x not in IMPLS:
            ap.error(f"unknown implementation {x!r}; known: {', '.join(IMPLS)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        raise SystemExit("profile_core.py: needs valgrind (callgrind and callgrind_annotate) on PATH")
    if "floor" in impls:
        from floor_build import build

        build()  # outside valgrind
    work = a.keep or Path(tempfile.mkdtemp(prefix="sfq-callgrind-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for impl in impls:
            n = a.pairs
            if impl == "batch":  # whole batches: the difference of the two runs' block counts
                b = max(1, min(1024, a.T // 4))
                n = b * (max(1, 2 * a.pairs // b) - max(1, a.pairs // b))
            f1 = callgrind(impl, a.T, a.pairs, work, [])
            f2 = callgrind(impl, a.T, 2 * a.pairs, work, [])
            rows = per_pair(f1, f2, n)
            print(report(impl, a.T, rows, a.top), flush=True)
            if a.lines and impl in ("compiled", "batch"):
                print(line_misses(f1, f2, n, "_csfq", a.top), flush=True)
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
