#!/usr/bin/env bash
# A copy of this tree's HEAD in DIR, built (the core, and the engine that the build compiles
# with mypyc: sfq._compiled.MODULES), with more modules compiled by mypyc from their own source
# on top: to measure what compiling them would buy before the build does it (the engine's
# modules were measured this way before setup.py compiled them). Nothing here changes how sfq
# is built or installed. Then, from DIR, compare it with this tree, interleaved:
#   benchmarks/mypyc_tree.sh /tmp/sfq-mypyc sfq/dispatch/policy_calls.py && (cd /tmp/sfq-mypyc && \
#       PYTHON=python bash benchmarks/compare_acquire.sh "$OLDPWD" 5)
# ("this" is then the copy, "old" this tree), or run the suite on it:
#   (cd /tmp/sfq-mypyc && PYTHONPATH=python python -m pytest -q -p no:cacheprovider tests)
# Needs mypy (which ships mypyc) and Cython in the Python that runs it. The copy is of the
# last commit (git archive): uncommitted changes are not in it. The modules given are compiled
# together with the engine's (one group), so that their calls into it are native.
# Usage: benchmarks/mypyc_tree.sh DIR MODULE.py ...  (modules relative to python/)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: benchmarks/mypyc_tree.sh DIR MODULE.py ...}
shift
[ $# -gt 0 ] || { echo "usage: benchmarks/mypyc_tree.sh DIR MODULE.py ... (the engine's are compiled already)"; exit 2; }
PY=${PYTHON:-python}
ENGINE=$(PYTHONPATH=python "$PY" -c "from sfq._compiled import MODULES; print(' '.join(m.replace('.', '/') + '.py' for m in MODULES))")
MODULES=($ENGINE "$@")
rm -rf "$DIR"
mkdir -p "$DIR"
git archive HEAD | tar -x -C "$DIR"
cd "$DIR"
SFQ_MYPYC=1 "$PY" setup.py -q build_ext --inplace >/dev/null  # (in place, the engine is compiled on request)
(cd python && "$PY" -m mypyc "${MODULES[@]}" >/dev/null)
rm -rf python/build
"$PY" - "${MODULES[@]}" <<'PYEOF'
import importlib, sys
sys.path.insert(0, "python")
for path in sys.argv[1:]:
    name = path.removesuffix(".py").replace("/", ".")
    mod = importlib.import_module(name)
    assert mod.__file__.endswith(".so"), f"{name} was not compiled: {mod.__file__}"
    print(f"{name}: {mod.__file__.rsplit('/', 1)[-1]}")
PYEOF
