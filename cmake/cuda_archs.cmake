# The GPU architectures of the CUDA kernels. XENT_CUDA_ARCHS (a CMake cache entry, or the
# environment variable of that name, so `XENT_CUDA_ARCHS="80;90a;100" pip wheel .` works) lists
# compute capabilities from 80 up (80, 86, 89, 90, 90a, 100, 120, ...); each gets a cubin
# (SASS), and the highest also gets PTX in its portable form (90a -> compute_90), which the
# driver compiles for GPUs newer than any listed.
#
# Compute capability 9.0 runs the Hopper paths (clusters, bulk copies, the fused sm_90a products,
# built whenever the list holds a 90 entry); every other GPU runs the portable paths, which need
# nothing newer than sm_80 (docs/architecture.md#devices). An sm_80 cubin runs on every 8.x GPU.
#
# Unset, the list is the local GPUs' compute capabilities (nvidia-smi), or "80;90" where no GPU
# is visible (a CPU machine: sm_80 code for Ampere and Ada, sm_90 for Hopper, compute_90 PTX for
# later GPUs). Setting CMAKE_CUDA_ARCHITECTURES directly (the gpu preset) bypasses all this.
set(xent_archs_default "80;90")
find_program(XENT_NVIDIA_SMI nvidia-smi)
mark_as_advanced(XENT_NVIDIA_SMI)
if(XENT_NVIDIA_SMI)
  execute_process(COMMAND "${XENT_NVIDIA_SMI}" --query-gpu=compute_cap --format=csv,noheader
                  OUTPUT_VARIABLE xent_local_caps RESULT_VARIABLE xent_smi_status
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(xent_smi_status EQUAL 0 AND xent_local_caps MATCHES "^[0-9]+\\.[0-9]")
    string(REPLACE "." "" xent_local_caps "${xent_local_caps}")
    string(REGEX REPLACE "[\r\n]+" ";" xent_local_caps "${xent_local_caps}")
    list(REMOVE_DUPLICATES xent_local_caps)
    set(xent_archs_default "${xent_local_caps}")
  endif()
endif()
if(NOT "$ENV{XENT_CUDA_ARCHS}" STREQUAL "")
  set(XENT_CUDA_ARCHS "$ENV{XENT_CUDA_ARCHS}" CACHE STRING "" FORCE)
endif()
set(XENT_CUDA_ARCHS "${xent_archs_default}" CACHE STRING
    "GPU architectures of the CUDA kernels, e.g. \"90\" or \"80;90a;100\" (PTX added for the highest)")

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  string(REGEX REPLACE "[ ,;]+" ";" xent_archs "${XENT_CUDA_ARCHS}")
  list(REMOVE_ITEM xent_archs "")
  set(xent_cuda_architectures "")
  set(xent_highest 0)
  foreach(arch IN LISTS xent_archs)
    string(REGEX REPLACE "^sm_" "" arch "${arch}")
    if(NOT arch MATCHES "^([0-9]+)[af]?$")
      message(FATAL_ERROR "XENT_CUDA_ARCHS: '${arch}' is not a compute capability such as 80, 90a "
                          "or 100 (got \"${XENT_CUDA_ARCHS}\")")
    endif()
    set(number "${CMAKE_MATCH_1}")
    if(number LESS 80)
      message(FATAL_ERROR "XENT_CUDA_ARCHS: sm_${arch} is not supported (got \"${XENT_CUDA_ARCHS}\"): "
                          "the kernels need sm_80 or later (cp.async, bf16); expected entries of "
                          "80 or more, e.g. \"80;90\"")
    endif()
    list(APPEND xent_cuda_architectures "${arch}-real")
    if(number GREATER xent_highest)
      set(xent_highest ${number})
    endif()
  endforeach()
  if(NOT xent_cuda_architectures)
    message(FATAL_ERROR "XENT_CUDA_ARCHS is empty; expected e.g. \"80;90\"")
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
