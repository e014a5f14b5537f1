#!/usr/bin/env bash
# Create .venv (once) and install natsim into it with its test tools.
# torch is installed first, pinned to the CPU build this machine kind carries on disk (where pip's find-links
# point), so that nothing resolves an unpinned `torch` to a multi-GB CUDA build. A GPU machine with torch
# already present can skip this script and `pip install -e '.[test]'` directly.
# Everything goes through uv, which downloads and unpacks in parallel: torch in about 10 s on a fresh machine here
# (pip took 17 s), the rest in a few. The venv is made without pip (ensurepip alone took 6 s); uv is installed
# into it by $PYTHON's pip and puts pip in with the test tools. Wherever uv cannot be had or fails, pip installs
# as it did before. The whole set-up: about 12 s on a fresh machine here, 27 s before.
# Nothing is byte-compiled at install (pip would compile every module of every package, torch's thousands
# included: about 17 s here); Python compiles what is imported on first use (scripts/test.sh lets it keep that).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PIP_OPTIONS=(--quiet --disable-pip-version-check --no-compile)
UV=(.venv/bin/uv pip install --quiet --python .venv/bin/python)
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --without-pip .venv
fi

venv_pip() {  # the venv's own pip, made with ensurepip where the venv has none yet
  if [ ! -x .venv/bin/pip ]; then
    .venv/bin/python -m ensurepip --upgrade --default-pip >/dev/null
  fi
  .venv/bin/pip install "${PIP_OPTIONS[@]}" "$@"
}

if [ ! -x .venv/bin/uv ]; then
  "$PYTHON" -m pip --python .venv/bin/python install "${PIP_OPTIONS[@]}" uv 2>/dev/null \
    || venv_pip uv || echo "setup: no uv, installing with pip" >&2
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # uv reads no pip configuration: it is given pip's find-links, and no index, so that only a wheel on disk does.
  links=$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u)
  if ! { [ -x .venv/bin/uv ] && [ -n "$links" ] \
         && "${UV[@]}" --no-index --no-deps $(printf -- '--find-links %s ' $links) "torch==2.13.0"; }; then
    venv_pip "torch==2.13.0"
  fi
fi
# The rest (torch's own dependencies among them); uv keeps the torch above, which satisfies the extras' `torch>=2.4`.
if ! { [ -x .venv/bin/uv ] && "${UV[@]}" pip -e ".[test,plot]"; }; then
  echo "setup: uv could not install the test tools, installing them with pip" >&2
  venv_pip -e ".[test,plot]"
fi
