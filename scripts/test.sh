#!/usr/bin/env bash
# Set up, then run the test suite on the CPU (Triton kernels run in its interpreter), spread over the
# machine's cores by pytest-xdist (pass `-n 0` to run in one process), the slowest tests listed at the end.
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# setup.sh installs without compiling bytecode; let Python write it as the tests import modules, so that the
# xdist workers and the processes tests spawn (gloo worlds, torchrun, the CLI) do not each compile torch from
# source again where PYTHONDONTWRITEBYTECODE is set.
unset PYTHONDONTWRITEBYTECODE
# worksteal: an idle worker takes half of the queue of a busy one, so the few slow interpreter tests do not
# leave one worker running alone at the end (`load` sends fixed chunks and idled a worker for longer here).
.venv/bin/python -m pytest -q -n auto --dist worksteal --durations=15 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing." >&2
  exit 1
fi
exit "$status"
