# Test package.cpp_consumer (cmake -P): installs the C++ package from the build directory (no
# rebuild), then configures, builds and runs examples/cpp-consumer against it twice: through
# find_package(xent) and through pkg-config (when there is one).
foreach(variable BUILD_DIR SOURCE_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${variable})
    message(FATAL_ERROR "check_consumer.cmake: -D${variable}=... is required")
  endif()
endforeach()

set(work "${BUILD_DIR}/package-test")
set(prefix "${work}/prefix")
file(REMOVE_RECURSE "${work}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "failed (${status}): ${command}")
  endif()
endfunction()

run("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" --component cpp)
run("${CMAKE_COMMAND}" -S "${SOURCE_DIR}/examples/cpp-consumer" -B "${work}/cmake" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_PREFIX_PATH=${prefix}" -Wno-dev)
run("${CMAKE_COMMAND}" --build "${work}/cmake")
run("${work}/cmake/xent-consumer")

find_program(PKG_CONFIG NAMES pkg-config pkgconf)
if(PKG_CONFIG)
  file(GLOB pc_file "${prefix}/lib*/pkgconfig/xent.pc" "${prefix}/lib/*/pkgconfig/xent.pc")
  get_filename_component(pc_dir "${pc_file}" DIRECTORY)
  set(ENV{PKG_CONFIG_PATH} "${pc_dir}")
  execute_process(COMMAND "${PKG_CONFIG}" --cflags --libs xent OUTPUT_VARIABLE flags
                  OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  execute_process(COMMAND "${PKG_CONFIG}" --variable=libdir xent OUTPUT_VARIABLE libdir
                  OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  message(STATUS "pkg-config --cflags --libs xent: ${flags}")
  separate_arguments(flags UNIX_COMMAND "${flags}")
  # The run path finds a shared libxent outside the system directories, as LD_LIBRARY_PATH would.
  run("${CXX_COMPILER}" -std=c++20 -O2 "${SOURCE_DIR}/examples/cpp-consumer/main.cpp" ${flags}
      "-Wl,-rpath,${libdir}" -o "${work}/xent-consumer-pkg-config")
  run("${work}/xent-consumer-pkg-config")
endif()
