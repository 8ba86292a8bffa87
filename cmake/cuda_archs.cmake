# The GPU architectures the CUDA kernels are compiled for. XENT_CUDA_ARCHS (a CMake cache entry, or
# the environment variable of that name, so `XENT_CUDA_ARCHS="90a;100" pip wheel .` works) lists
# compute capabilities; each gets a cubin (SASS), and the highest also gets PTX in its portable
# form (90a -> compute_90), which the driver compiles for GPUs newer than any listed.
#
# 90 is the lowest: the row kernels (src/cuda/rows/row_slice.cuh) hold a row in a thread-block
# cluster's shared memory, fill it with cp.async.bulk on mbarriers and exchange statistics through
# distributed shared memory, all sm_90 features with no sm_80 form. The default, 90, gives the
# sm_90 cubin that H100/H200 run and compute_90 PTX for later GPUs; 90a adds nothing these
# kernels use (no wgmma/setmaxnreg), at the price of a second device compilation.
# Setting CMAKE_CUDA_ARCHITECTURES directly (the gpu preset) bypasses all this.
set(xent_archs_default "90")
if(NOT "$ENV{XENT_CUDA_ARCHS}" STREQUAL "")
  set(XENT_CUDA_ARCHS "$ENV{XENT_CUDA_ARCHS}" CACHE STRING "" FORCE)
endif()
set(XENT_CUDA_ARCHS "${xent_archs_default}" CACHE STRING
    "GPU architectures of the CUDA kernels, e.g. \"90\" or \"90a;100\" (PTX added for the highest)")

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  string(REGEX REPLACE "[ ,;]+" ";" xent_archs "${XENT_CUDA_ARCHS}")
  list(REMOVE_ITEM xent_archs "")
  set(xent_cuda_architectures "")
  set(xent_highest 0)
  foreach(arch IN LISTS xent_archs)
    string(REGEX REPLACE "^sm_" "" arch "${arch}")
    if(NOT arch MATCHES "^([0-9]+)[af]?$")
      message(FATAL_ERROR "XENT_CUDA_ARCHS: '${arch}' is not a compute capability such as 90, 90a "
                          "or 100 (got \"${XENT_CUDA_ARCHS}\")")
    endif()
    set(number "${CMAKE_MATCH_1}")
    if(number LESS 90)
      message(FATAL_ERROR "XENT_CUDA_ARCHS: sm_${arch} is not supported (got \"${XENT_CUDA_ARCHS}\"): "
                          "the row kernels need sm_90 or later (thread-block clusters, "
                          "cp.async.bulk); expected entries of 90 or more, e.g. \"90\" or \"90a;100\"")
    endif()
    list(APPEND xent_cuda_architectures "${arch}-real")
    if(number GREATER xent_highest)
      set(xent_highest ${number})
    endif()
  endforeach()
  if(NOT xent_cuda_architectures)
    message(FATAL_ERROR "XENT_CUDA_ARCHS is empty; expected e.g. \"90\"")
  endif()
  # "90-real" with "90-virtual" is CMake's "90": one device compilation gives both.
  list(FIND xent_cuda_architectures "${xent_highest}-real" same_real)
  if(same_real GREATER -1)
    list(REMOVE_AT xent_cuda_architectures ${same_real})
    list(APPEND xent_cuda_architectures "${xent_highest}")
  else()
    list(APPEND xent_cuda_architectures "${xent_highest}-virtual")
  endif()
  set(CMAKE_CUDA_ARCHITECTURES "${xent_cuda_architectures}")
endif()

# What the build info reports: the cubins (sm_*) and PTX (compute_*) in the library.
set(XENT_CUDA_SASS "")
set(XENT_CUDA_PTX "")
foreach(entry IN LISTS CMAKE_CUDA_ARCHITECTURES)
  string(REGEX MATCH "^[0-9]+[af]?" arch "${entry}")
  if(NOT entry MATCHES "-virtual$")
    list(APPEND XENT_CUDA_SASS "sm_${arch}")
  endif()
  if(NOT entry MATCHES "-real$")
    list(APPEND XENT_CUDA_PTX "compute_${arch}")
  endif()
endforeach()
message(STATUS "xent: CUDA architectures ${CMAKE_CUDA_ARCHITECTURES} (cubins: ${XENT_CUDA_SASS}; PTX: ${XENT_CUDA_PTX})")
