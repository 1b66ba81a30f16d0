#!/usr/bin/env bash
# A copy of this tree's HEAD in DIR with the request engine compiled by mypyc from its own
# source (the modules below, or those given), beside the compiled core: to measure what
# compiling the engine would buy before the build does it. Nothing here changes how sfq is
# built or installed. Then, from DIR, compare it with this tree, interleaved:
#   benchmarks/mypyc_tree.sh /tmp/sfq-mypyc && (cd /tmp/sfq-mypyc && \
#       PYTHON=python bash benchmarks/compare_acquire.sh "$OLDPWD" 5)
# ("this" is then the compiled engine, "old" the source), or run the suite on it:
#   (cd /tmp/sfq-mypyc && PYTHONPATH=python python -m pytest -q -p no:cacheprovider tests)
# Needs mypy (which ships mypyc) and Cython in the Python that runs it. The copy is of the
# last commit (git archive): uncommitted changes are not in it.
# Usage: benchmarks/mypyc_tree.sh DIR [MODULE.py ...]  (modules relative to python/)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: benchmarks/mypyc_tree.sh DIR [MODULE.py ...]}
shift
MODULES=("$@")
if [ ${#MODULES[@]} -eq 0 ]; then
    MODULES=(sfq/engine/pool.py sfq/engine/engine.py sfq/policy/limits.py sfq/policy/retry.py
             sfq/backends/health.py)
fi
PY=${PYTHON:-python}
rm -rf "$DIR"
mkdir -p "$DIR"
git archive HEAD | tar -x -C "$DIR"
cd "$DIR"
"$PY" setup.py -q build_ext --inplace >/dev/null
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
