#!/usr/bin/env bash
# Run the test suite against megatron-core 0.19.2 on Python 3.11 (the 0.19 line normally needs Python 3.12).
#
# megatron-core 0.19.2 ships only cp312 wheels, but every source file parses on 3.11, so we build it from the
# sdist with --ignore-requires-python. It imports triton unconditionally (~1 GB on disk). The venv lives outside
# the repository (default /tmp/adacc-venv019) and is reused.
#
# usage: scripts/test_megatron_019.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ADACC_VENV019:-/tmp/adacc-venv019}
PY=$VENV/bin/python
if [ ! -x "$PY" ] || ! "$PY" -c "import megatron.core, triton" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q numpy packaging pulp pybind11 tqdm setuptools wheel ninja \
      pytest pytest-xdist pytest-timeout hypothesis matplotlib
  "$PY" -m pip install -q --no-deps --ignore-requires-python --no-binary megatron-core megatron-core==0.19.2
  "$PY" -m pip install -q triton
fi
"$PY" -c "import megatron.core; print('megatron-core', megatron.core.__version__)"
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
exec "$PY" -m pytest -n 2 -m "not slow" --timeout 900 -q -p no:cacheprovider "$@"
