#!/usr/bin/env bash
# Installs what the Python package's build and tests need, from PyPI: torch (the version pinned
# in pyproject.toml's build requirements, the one place it is set), pytest, and transformers for
# the Hugging Face patch tests, matplotlib for the plotting tool's test. Quick and quiet when all is there. An installed torch >= 2.4 is
# kept as it is (the package supports 2.4 and later), so a machine with its own torch (a GPU box)
# is never reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="$(sed -n 's/.*"torch==\([0-9][0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)"
[ -n "$TORCH_VERSION" ] || { echo "deps-python: no torch pin in pyproject.toml" >&2; exit 1; }
TRANSFORMERS_VERSION="5.17.0"
PYTHON="${PYTHON:-python3}"

have() { "$PYTHON" -c "$1" >/dev/null 2>&1; }

need=()
have "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 4))" \
  || need+=("torch==${TORCH_VERSION}")
have "import pytest" || need+=(pytest)
have "import numpy" || need+=(numpy)
have "import transformers" || need+=("transformers==${TRANSFORMERS_VERSION}")
have "import matplotlib" || need+=("matplotlib==3.11.2")

if [ ${#need[@]} -gt 0 ]; then
  echo "deps-python: installing ${need[*]}"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${need[@]}"
fi
