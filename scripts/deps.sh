#!/usr/bin/env bash
# Installs what building and testing xent needs on Debian 12 (root): quiet and quick when all
# is there already. The CUDA toolkit is optional: the CUDA backend is compiled when nvcc is found.
# --cpu: a build without the CUDA backend (make run on a machine without a GPU) needs no CUTLASS.
set -euo pipefail

mode="${1:-}"
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v clang-format-14 >/dev/null || command -v clang-format >/dev/null || need+=(clang-format)
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

# CUTLASS / CuTe headers (header-only) for the fused Hopper kernels, when the CUDA backend can be
# built: the nvidia-cutlass wheel's cutlass_library/source/include, unpacked into
# third_party/cutlass-<version>/include. The version is pinned in cmake/cutlass.cmake. A machine
# without internet takes the wheel (or a tarball of that include folder) from XENT_CUTLASS_TARBALL,
# or the folder carried over as it is.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cutlass_version="$(sed -n 's/^set(XENT_CUTLASS_VERSION \([0-9.]*\)).*/\1/p' "$root/cmake/cutlass.cmake")"
cutlass_dir="$root/third_party/cutlass-$cutlass_version"
if [ "$mode" != "--cpu" ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   [ ! -f "$cutlass_dir/include/cute/tensor.hpp" ]; then
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
  archive="${XENT_CUTLASS_TARBALL:-}"
  if [ -z "$archive" ]; then
    echo "deps: fetching CUTLASS $cutlass_version headers (nvidia-cutlass wheel)"
    if python3 -m pip download -q --no-deps --only-binary=:all: "nvidia-cutlass==$cutlass_version" \
         -d "$scratch" >/dev/null 2>&1; then
      archive="$(ls "$scratch"/nvidia_cutlass-*.whl)"
    fi
  fi
  if [ -n "$archive" ] && [ -f "$archive" ]; then
    mkdir -p "$cutlass_dir"
    python3 - "$archive" "$cutlass_dir" <<'PY'
import os, sys, tarfile, zipfile
archive, dest = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
def target(name):
    # A wheel holds the headers under prefix; a tarball holds include/... (or the prefix).
    for head in (prefix, "include/"):
        if head in name:
            return os.path.join(dest, "include", name.split(head, 1)[1])
    return None
if zipfile.is_zipfile(archive):
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            out = target(info.filename)
            if out and not info.is_dir():
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(info) as src, open(out, "wb") as dst:
                    dst.write(src.read())
else:
    with tarfile.open(archive) as t:
        for member in t.getmembers():
            out = target(member.name)
            if out and member.isfile():
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with t.extractfile(member) as src, open(out, "wb") as dst:
                    dst.write(src.read())
PY
  else
    echo "deps: CUTLASS $cutlass_version headers unavailable (no network, no XENT_CUTLASS_TARBALL):" \
         "the fused Hopper product is left out of the build"
  fi
fi

# nvcc lives outside PATH on a stock toolkit install.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "deps: CUDA toolkit at /usr/local/cuda (add /usr/local/cuda/bin to PATH to use it)"
fi
