#!/usr/bin/env bash
# Create .venv (once) and install natsim into it with its test tools.
# torch is installed first, pinned to the CPU build this machine kind carries on disk, so that pip
# does not resolve an unpinned `torch` to a multi-GB CUDA build. A GPU machine with torch already
# present can skip this script and `pip install -e '.[test]'` directly.
# Nothing is byte-compiled at install (pip would compile every module of every package, torch's thousands
# included: about 17 s here); Python compiles what is imported on first use (scripts/test.sh lets it keep that).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet --disable-pip-version-check --no-compile "torch==2.13.0"
fi
# The rest through uv, which downloads and unpacks in parallel (about 9 s on a fresh machine here, pip 26 s; it
# keeps the torch above, which satisfies the extras' `torch>=2.4`), and through pip wherever uv fails.
if ! { .venv/bin/pip install --quiet --disable-pip-version-check --no-compile uv \
       && .venv/bin/uv pip install --quiet --python .venv/bin/python -e ".[test,plot]"; }; then
  echo "setup: uv could not install the test tools, installing them with pip" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check --no-compile -e ".[test,plot]"
fi
