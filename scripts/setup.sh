#!/usr/bin/env bash
# Create .venv (once) and install natsim into it with its test tools.
# torch is installed first, pinned to the CPU build this machine kind carries on disk, so that pip
# does not resolve an unpinned `torch` to a multi-GB CUDA build. A GPU machine with torch already
# present can skip this script and `pip install -e '.[test]'` directly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test,plot]"
