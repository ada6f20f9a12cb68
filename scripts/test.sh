#!/usr/bin/env bash
# Fast test suite from a fresh clone: creates .venv if missing, installs the CPU build of
# torch 2.13.0 first (so no CUDA wheel is downloaded), installs dmc[dev], runs pytest.
#   bash scripts/test.sh            fast suite
#   bash scripts/test.sh --slow     slow-marked tests only
#   bash scripts/test.sh -k NAME    any extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
bash scripts/install_torch.sh
python -m pip install -q -e ".[dev]"

args=()
if [ "${1:-}" = "--slow" ]; then
  shift
  args=(-m slow)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec python -m pytest -q "${args[@]}" "$@"
