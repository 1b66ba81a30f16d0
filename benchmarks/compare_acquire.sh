#!/usr/bin/env bash
# bench_acquire.py and bench_dispatcher.py's sequential group on this tree and on OLD_TREE (a
# checkout with its compiled core built in place), interleaved ROUNDS times on this machine, so
# that drift in the machine's speed hits both alike. Prints each run's medians (microseconds per
# request), then per benchmark the median over the rounds on each tree and the median (and range)
# of the rounds' paired ratios this/old. Usage: benchmarks/compare_acquire.sh OLD_TREE [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$(cd "$1" && pwd); ROUNDS=${2:-3}; PY=${PYTHON:-python}
LOG=$(mktemp)
for i in $(seq "$ROUNDS"); do
    for tree in "$PWD" "$OLD"; do
        out=$(mktemp)
        cp benchmarks/bench_acquire.py "$tree/benchmarks/_cmp_acquire.py"  # (this tree's file, the tree's conftest)
        (cd "$tree" && PYTHONPATH="$tree/python" "$PY" -m pytest -q -p no:cacheprovider benchmarks/_cmp_acquire.py \
            benchmarks/bench_dispatcher.py::test_seq_dispatcher benchmarks/bench_dispatcher.py::test_seq_direct \
            -k "not reference" --benchmark-only --benchmark-json="$out" >/dev/null 2>&1) || true
        rm -f "$tree/benchmarks/_cmp_acquire.py"
        "$PY" - "$out" "$tree" <<'PYEOF'
import json, sys
doc = json.load(open(sys.argv[1]))
row = {b["name"]: b["stats"]["median"] / b["extra_info"]["requests"] * 1e6 for b in doc["benchmarks"]}
print(sys.argv[2].rsplit("/", 1)[-1].ljust(10), "  ".join(f"{k.removeprefix('test_')}={v:.1f}" for k, v in sorted(row.items())))
PYEOF
        rm -f "$out"
    done
done | tee "$LOG"
"$PY" - "$LOG" <<'PYEOF'
import re, statistics as st, sys
lines = [ln.split(None, 1) for ln in open(sys.argv[1]) if ln.strip()]
runs = [dict((k, float(v)) for k, v in re.findall(r"(\S+)=([\d.]+)", rest)) for _, rest in lines]
this, old = runs[0::2], runs[1::2]
print(f"\n{'per request (us)':30} {'this':>7} {'old':>7}  this/old paired (range)")
for k in sorted(this[0]):
    a = [r[k] for r in this if k in r]
    b = [r[k] for r in old if k in r]
    pairs = sorted(x / y for x, y in zip(a, b) if y)
    ratio = f"{st.median(pairs):.2f} ({pairs[0]:.2f}-{pairs[-1]:.2f})" if pairs else "-"
    print(f"{k:30} {st.median(a):7.1f} {st.median(b) if b else float('nan'):7.1f}  {ratio}")
PYEOF
rm -f "$LOG"
