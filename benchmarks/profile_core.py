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
def run_workload(impl: str, T: int, pairs: int, draw: int) -> None:
    """Build the steady state of bench_core.py at T, warm it up, then run `pairs` pairs
    (drawing the inputs of `draw` >= `pairs` pairs, so that two runs draw the same)."""
    import numpy as np

    import bench_core as bc

    # the inputs of `draw` pairs are drawn whatever `pairs` is, so that drawing them cancels
    # out of the difference of two runs; only the first `pairs` are used
    draw = max(draw, pairs)
    if impl in ("compiled", "batch"):
        rng = bc.rng_for("steady" if impl == "compiled" else "batch", T)
        s = bc.build_backlogged("compiled", T, rng)
        bc.steady_pairs(s, bc.costs(rng, max(T, 1000)))
        if impl == "compiled":
            bc.steady_pairs(s, bc.costs(rng, draw)[:pairs])
        else:
            n = max(1, min(1024, T // 4))
            blocks = [rng.integers(1, bc.MAX_COST + 1, n).astype(np.float64) for _ in range(max(1, draw // n))]
            bc.batch_pairs(s, n, blocks[: max(1, pairs // n)])
    elif impl == "minimal":
        m, rng = bc.build_minimal(T)
        bc.minimal_pairs(m, bc.costs(rng, draw)[:pairs])
    elif impl == "floor":
        from floor_build import load_cfloor

        fl, rng = bc.build_floor(load_cfloor(), T)
        fl.steady(np.asarray(bc.costs(rng, draw))[:pairs])
    else:
        raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")


# --------------------------------------------------------------------------- a debug build of the core
ROOT = HERE.parent
DEBUG_CORE = HERE / "build" / "debug-core"  # git-ignored (benchmarks/build/)


def core_revision() -> str:
    """The last commit touching src/csfq, and whether the working tree differs from it."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else "?"

    rev = git("log", "-1", "--format=%h", "--", "src/csfq")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src/csfq")
    return rev + (" (with uncommitted changes to src/csfq)" if dirty not in ("", "?") else "")


def build_debug_core() -> Path:
    """python/sfq (Python files) plus src/csfq built with -O3 -g, in DEBUG_CORE; returns the
    folder to put first on PYTHONPATH. Rebuilt when any source is newer than the build."""
    pkg_src, out = ROOT / "python" / "sfq", DEBUG_CORE / "sfq"
    sources = [ROOT / "src" / "csfq" / "_csfq.pyx", *sorted((ROOT / "src" / "csfq").glob("*.h"))]
    built = sorted(out.glob("_csfq*.so")) if out.exists() else []
    if built and built[0].stat().st_mtime >= max(p.stat().st_mtime for p in sources):
        stale = False
    else:
        stale = True
    if out.exists():  # refresh the Python files (cheap), keep the built module if not stale
        for p in out.rglob("*.py"):
            p.unlink()
    shutil.copytree(pkg_src, out, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    if not stale:
        return DEBUG_CORE
    from setuptools import Distribution, Extension  # first: see floor_build.py
    from Cython.Build import cythonize

    ext = Extension("sfq._csfq", [str(sources[0])], include_dirs=[str(ROOT / "src" / "csfq")],
                    extra_compile_args=["-O3", "-g"])
    mods = cythonize(  # type: ignore[no-untyped-call]
        [ext], build_dir=str(DEBUG_CORE / "c"), quiet=True, language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True,
                             "initializedcheck": False, "embedsignature": True})
    dist = Distribution({"name": "sfq-debug-core", "ext_modules": mods})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(DEBUG_CORE)
    cmd.build_temp = str(DEBUG_CORE / "tmp")
    cmd.force = True
    cmd.ensure_finalized()
    print(f"profile_core.py: building a debug copy of the core in {DEBUG_CORE} ...", file=sys.stderr, flush=True)
    cmd.run()
    return DEBUG_CORE


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
    if name.startswith("_heapq") or name.startswith("_collections"):
        return "stdlib C modules (_heapq)"
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


def callgrind(impl: str, T: int, pairs: int, draw: int, workdir: Path, core: Path | None) -> Path:
    out = workdir / f"callgrind.{impl}.{T}.{pairs}.out"
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", LL_MODEL, f"--callgrind-out-file={out}",
           sys.executable, str(Path(__file__).resolve()), "--run", impl, "--T", str(T), "--pairs", str(pairs),
           "--draw", str(draw)]
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    if core is not None:  # the debug build of the core first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(core), env.get("PYTHONPATH")]))
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
    """The object file of a 'file:function [object]' row; callgrind_annotate leaves it out for
    code inlined from another source file, so then it is told by the function's name."""
    m = re.search(r"\[([^\]]+)\]\s*$", key)
    if m:
        return m.group(1)
    path, _, fn = key.rpartition(":")
    if "_csfq" in fn or "csfq/" in path:
        return "_csfq (inlined)"
    if "cfloor" in fn or "cfloor" in path:
        return "cfloor (inlined)"
    if re.match(r"_?Py", fn) or re.search(r"Python-3|/(Objects|Python|Include|Modules|Parser)/|python3\.", path):
        return "libpython (inlined)"
    return "?"


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


def _annotated_lines(p: Path, hints: tuple[str, ...]) -> dict[tuple[str, int], list[int]]:
    """{(source file, line): [events]} for the annotated sources whose path contains a hint."""
    cmd = ["callgrind_annotate", "--threshold=100", "--show=" + ",".join(EVENTS), "--auto=yes",
           "--context=0", str(p)]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    out: dict[tuple[str, int], list[int]] = {}
    cur: str | None = None
    lineno = 0
    headed = False  # the separator right after a file's header line
    for line in text.splitlines():
        m = re.match(r"^-- (?:Auto|User)-annotated source: (.*)$", line)
        if m:
            cur = m.group(1).strip()
            cur = cur if any(h in cur for h in hints) else None
            lineno, headed = 1, True
            continue
        if re.match(r"^-{20,}\s*$", line):  # a file's annotation ends (next file or the summary)
            if headed:
                headed = False
            else:
                cur = None
            continue
        if cur is None:
            continue
        m = re.match(r"^-- line (\d+) -+", line)
        if m:
            lineno = int(m.group(1))
            continue
        toks = _PERC.sub(" ", line).split()
        nums: list[int] = []
        for t in toks[: len(EVENTS)]:
            if re.fullmatch(r"[\d,]+", t):
                nums.append(int(t.replace(",", "")))
            elif t == ".":
                nums.append(0)
            else:
                break
        if len(nums) == len(EVENTS):
            if toks[len(EVENTS):len(EVENTS) + 1] == ["=>"]:  # a call's inclusive cost, not a line
                continue
            out[(cur, lineno)] = nums
            lineno += 1
    return out


_PYX_TEXT: dict[tuple[str, int], str] = {}  # (.pyx name, line) -> its text, as Cython quoted it


def _pyx_map(c_file: Path) -> tuple[dict[int, int], Path | None]:
    """C line -> the .pyx line its code came from (Cython's `/* "x.pyx":N` comments, which also
    quote the line: the text is taken from there, so a .pyx edited since the build cannot skew it)."""
    mapping: dict[int, int] = {}
    pyx: Path | None = None
    cur = 0
    try:
        lines = c_file.read_text(errors="replace").splitlines()
    except OSError:
        return mapping, None
    for i, line in enumerate(lines, 1):
        if line.startswith("/* #### Code section:"):  # Cython's own utility code has no .pyx line
            cur = 0
        m = re.match(r'\s*/\* "([^"]+\.pyx)":(\d+)', line)
        if m:
            cur = int(m.group(2))
            if pyx is None:
                pyx = Path(m.group(1))
        elif cur and pyx is not None and line.rstrip().endswith("# <<<<<<<<<<<<<<"):
            _PYX_TEXT.setdefault((pyx.name, cur), line.strip().lstrip("*").rsplit("#", 1)[0].strip())
        mapping[i] = cur
    return mapping, pyx


def line_misses(a: Path, b: Path, pairs: int, top: int) -> str:
    """The core's source lines (its .pyx, and sfq_heap.h) with the most D1 misses per pair."""
    hints = ("_csfq.c", "sfq_heap.h")
    la, lb = _annotated_lines(a, hints), _annotated_lines(b, hints)
    maps: dict[str, tuple[dict[int, int], Path | None]] = {}
    agg: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0] * len(EVENTS))
    for k in set(la) | set(lb):
        f, n = k
        x, y = la.get(k, [0] * len(EVENTS)), lb.get(k, [0] * len(EVENTS))
        d = [(yy - xx) / pairs for xx, yy in zip(x, y)]
        if f.endswith(".c"):
            if f not in maps:
                maps[f] = _pyx_map(Path(f) if Path(f).is_absolute() else ROOT / f)
            mp, pyx = maps[f]
            key = (str(pyx) if pyx else f, mp.get(n, 0))
        else:
            key = (f, n)
        for i, v in enumerate(d):
            agg[key][i] += v
    texts: dict[str, list[str]] = {}

    def src(path: str, n: int) -> str:
        if (os.path.basename(path), n) in _PYX_TEXT:
            return _PYX_TEXT[(os.path.basename(path), n)]
        if path not in texts:
            p = Path(path)
            if not p.is_absolute():
                p = ROOT / path
            texts[path] = p.read_text(errors="replace").splitlines() if p.exists() else []
        t = texts[path]
        return t[n - 1].strip() if 0 < n <= len(t) else "?"

    rows = sorted(agg.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    L = ["The core's source lines with the most D1 misses per pair (the .pyx line a C line came "
         "from; sfq_heap.h as is):", "", "| line | source | " + " | ".join(EVENTS) + " |",
         "|---|---|" + "---:|" * len(EVENTS)]
    for (path, n), d in rows[:top]:
        if d[1] + d[2] < 0.05:
            break
        text = (src(path, n) if n else "(Cython's generated glue and utility code)").replace("|", "\\|")[:80]
        L.append(f"| {os.path.basename(path)}:{n or '-'} | `{text}` | " + " | ".join(fmt(x) for x in d) + " |")
    L.append("")
    return "\n".join(L)


def measured_pairs(impl: str, T: int, pairs: int) -> int:
    """Pairs by which the run with 2 * pairs exceeds the run with pairs (batch: whole batches)."""
    if impl != "batch":
        return pairs
    b = max(1, min(1024, T // 4))
    return b * (max(1, 2 * pairs // b) - max(1, pairs // b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Instruction and cache-miss counts per steady-state pair (callgrind).")
    ap.add_argument("--T", type=int, default=10_000, help="flows (default 10,000)")
    ap.add_argument("--pairs", type=int, default=20_000, help="pairs in the shorter of the two runs")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {','.join(IMPLS)}")
    ap.add_argument("--top", type=int, default=12, help="functions (and lines) to list")
    ap.add_argument("--lines", action="store_true", help="also list the core's source lines that miss D1 most")
    ap.add_argument("--keep", type=Path, default=None, help="keep the callgrind.out files in this folder")
    ap.add_argument("--from", dest="from_dir", type=Path, default=None, metavar="DIR",
                    help="report from the callgrind.out files a --keep run left in DIR (runs nothing)")
    ap.add_argument("--core", choices=("debug", "installed"), default="debug",
                    help="debug (default): profile a private build of src/csfq with -O3 -g (the same code "
                         "as the shipped -O3 -g0 build, plus the symbols and line tables callgrind needs), "
                         f"made in {DEBUG_CORE.relative_to(HERE.parent)}; installed: the sfq that Python imports")
    ap.add_argument("--run", metavar="IMPL", help=argparse.SUPPRESS)  # the workload itself (under valgrind)
    ap.add_argument("--draw", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.T < 1 or a.pairs < 1:
        ap.error(f"--T and --pairs must be >= 1, got {a.T} and {a.pairs}")
    if a.run:
        run_workload(a.run, a.T, a.pairs, a.draw)
        return 0
    impls = [x for x in a.impls.split(",") if x]
    for x in impls:
        if x not in IMPLS:
            ap.error(f"unknown implementation {x!r}; known: {', '.join(IMPLS)}")
    if a.from_dir is not None:
        for impl in impls:
            n = measured_pairs(impl, a.T, a.pairs)
            f1 = a.from_dir / f"callgrind.{impl}.{a.T}.{a.pairs}.out"
            f2 = a.from_dir / f"callgrind.{impl}.{a.T}.{2 * a.pairs}.out"
            if not (f1.exists() and f2.exists()):
                raise SystemExit(f"profile_core.py: {f1} or {f2} is missing")
            print(report(impl, a.T, per_pair(f1, f2, n), a.top), flush=True)
            if a.lines and impl in ("compiled", "batch"):
                print(line_misses(f1, f2, n, a.top), flush=True)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        raise SystemExit("profile_core.py: needs valgrind (callgrind and callgrind_annotate) on PATH")
    if "floor" in impls:
        from floor_build import build

        build()  # outside valgrind
    core = build_debug_core() if a.core == "debug" and ({"compiled", "batch"} & set(impls)) else None
    probe = subprocess.run([sys.executable, "-c", "import sfq; print(sfq.CORE, sfq._csfq.__file__)"],
                           capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                               filter(None, [str(core) if core else None, os.environ.get("PYTHONPATH")]))))
    print(f"core profiled: {probe.stdout.strip() or probe.stderr.strip()[-300:]}; src/csfq at {core_revision()}")
    print()
    work = a.keep or Path(tempfile.mkdtemp(prefix="sfq-callgrind-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for impl in impls:
            n = measured_pairs(impl, a.T, a.pairs)
            f1 = callgrind(impl, a.T, a.pairs, 2 * a.pairs, work, core)
            f2 = callgrind(impl, a.T, 2 * a.pairs, 2 * a.pairs, work, core)
            rows = per_pair(f1, f2, n)
            print(report(impl, a.T, rows, a.top), flush=True)
            if a.lines and impl in ("compiled", "batch"):
                print(line_misses(f1, f2, n, a.top), flush=True)
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
