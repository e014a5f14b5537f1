#!/usr/bin/env bash
# Set up, then run the test suite on the CPU (Triton kernels run in its interpreter).
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing." >&2
  exit 1
fi
exit "$status"
