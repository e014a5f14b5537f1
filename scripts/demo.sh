#!/usr/bin/env bash
# Set up, then run the main job on its built-in default: the HunyuanVideo layout of the GNA paper.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/natsim sweep --shape 30x48x80 --window 18x24x24 "$@"
