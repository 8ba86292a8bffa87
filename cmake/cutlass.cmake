# CUTLASS / CuTe C++ headers for the tensor-core kernels of our own (src/cuda/sm90/fused_stats_product.cu).
# Header-only, from the PyPI wheel `nvidia-cutlass` (cutlass_library/source/include). The version is
# pinned here and only here: scripts/deps.sh reads it from this line to fetch the wheel into
# third_party/cutlass-<version>/include (ignored by git).
set(XENT_CUTLASS_VERSION 4.2.0.0)
set(XENT_CUTLASS_INCLUDE_DIR "${PROJECT_SOURCE_DIR}/third_party/cutlass-${XENT_CUTLASS_VERSION}/include"
    CACHE PATH "CUTLASS/CuTe include directory (holds cutlass/ and cute/)")
if(EXISTS "${XENT_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp" AND
   EXISTS "${XENT_CUTLASS_INCLUDE_DIR}/cutlass/gemm/collective/collective_builder.hpp")
  set(XENT_WITH_CUTLASS ON)
else()
  set(XENT_WITH_CUTLASS OFF)
  message(WARNING "xent: CUTLASS headers not found in ${XENT_CUTLASS_INCLUDE_DIR} (run scripts/deps.sh, "
                  "or set XENT_CUTLASS_INCLUDE_DIR): the fused Hopper statistics product is left out "
                  "and linear_ce takes its cuBLASLt path everywhere")
endif()
message(STATUS "xent: CUTLASS ${XENT_WITH_CUTLASS} (${XENT_CUTLASS_INCLUDE_DIR})")
