#!/usr/bin/env bash
# bench_acquire.py and bench_dispatcher.py's sequential group on this tree and on OLD_TREE (a
# checkout with its compiled core built in place), interleaved ROUNDS times on this machine, so
# that drift in the machine's speed hits both alike. Prints each run's medians (microseconds per
# request). Usage: benchmarks/compare_acquire.sh OLD_TREE [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$(cd "$1" && pwd); ROUNDS=${2:-3}; PY=${PYTHON:-python}
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
done
