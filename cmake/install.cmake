# The C++ package: `cmake --install <build> --prefix P --component cpp` installs the public
# headers, libxent (static, or shared with BUILD_SHARED_LIBS=ON), the CMake package
# (find_package(xent CONFIG) -> imported target xent::xent) and a pkg-config file. The torch
# binding has its own component (python), which only pip installs.
include(CMakePackageConfigHelpers)

set(XENT_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/xent" CACHE STRING
    "Where the CMake package files of xent are installed, relative to the prefix")

install(TARGETS xent EXPORT xentTargets COMPONENT cpp
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/xent DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT cpp)
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/xent COMPONENT cpp)
install(EXPORT xentTargets NAMESPACE xent:: DESTINATION ${XENT_INSTALL_CMAKEDIR} COMPONENT cpp)

configure_package_config_file(cmake/xentConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/package/xentConfig.cmake
                              INSTALL_DESTINATION ${XENT_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/package/xentConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/xentConfig.cmake
              ${PROJECT_BINARY_DIR}/package/xentConfigVersion.cmake
        DESTINATION ${XENT_INSTALL_CMAKEDIR} COMPONENT cpp)

# pkg-config: a static libxent needs its dependencies on the link line of every consumer, so
# they go into Libs; a shared one records them itself (Libs.private, for --static only).
set(xent_pc_cflags "")
set(xent_pc_dependencies "${OpenMP_CXX_FLAGS}")
if(XENT_WITH_OPENBLAS)
  string(APPEND xent_pc_dependencies " -lopenblas")
endif()
if(XENT_WITH_CUDA)
  set(xent_pc_cflags " -DXENT_WITH_CUDA=1")
  string(APPEND xent_pc_dependencies " -L${CUDAToolkit_LIBRARY_DIR} -lcublasLt -lcudart")
endif()
if(BUILD_SHARED_LIBS)
  set(xent_pc_libs "-L\${libdir} -lxent")
  set(xent_pc_libs_private "${xent_pc_dependencies}")
else()
  set(xent_pc_libs "-L\${libdir} -lxent ${xent_pc_dependencies}")
  set(xent_pc_libs_private "")
endif()
# The prefix is found from the file's own place, so the installed tree can be moved.
file(RELATIVE_PATH xent_pc_to_prefix "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
string(REGEX REPLACE "/$" "" xent_pc_to_prefix "${xent_pc_to_prefix}")
configure_file(cmake/xent.pc.in ${PROJECT_BINARY_DIR}/package/xent.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/package/xent.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT cpp)
