#!/usr/bin/env bash
# Installs what building and testing xent needs on Debian 12 (root): quiet and quick when all
# is there already. The CUDA toolkit is optional: the CUDA backend is compiled when nvcc is found.
set -euo pipefail

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/x86_64-linux-gnu/cblas.h ] || [ -f /usr/include/cblas.h ] || \
  ls /usr/include/*/openblas*/cblas.h >/dev/null 2>&1 || need+=(libopenblas-dev)
ls /usr/lib/*/libopenblas.so >/dev/null 2>&1 || need+=(libopenblas-dev)

if [ ${#need[@]} -gt 0 ]; then
  echo "deps: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# nvcc lives outside PATH on a stock toolkit install.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "deps: CUDA toolkit at /usr/local/cuda (add /usr/local/cuda/bin to PATH to use it)"
fi
