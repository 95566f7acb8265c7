# The installable package: the layer libraries and the umbrella (exported as hp::<layer> and
# hp::hyperparallel), the public headers under include/hp, hyperparallelConfig.cmake (+ version)
# for find_package, and hyperparallel.pc for pkg-config. The benchmarks, tools and tests are not
# part of it. tests/package installs a build and builds a program against it.
include(CMakePackageConfigHelpers)

set(HP_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/hyperparallel)

install(TARGETS ${HP_LAYER_TARGETS} hp
  EXPORT hyperparallelTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/hp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT hyperparallelTargets
  NAMESPACE hp::
  DESTINATION ${HP_CMAKE_INSTALL_DIR})

configure_package_config_file(cmake/hyperparallelConfig.cmake.in
  ${PROJECT_BINARY_DIR}/hyperparallelConfig.cmake
  INSTALL_DESTINATION ${HP_CMAKE_INSTALL_DIR})
# 0.x: a minor version may break the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/hyperparallelConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/hyperparallelConfig.cmake
  ${PROJECT_BINARY_DIR}/hyperparallelConfigVersion.cmake
  DESTINATION ${HP_CMAKE_INSTALL_DIR})

# pkg-config. Relocatable: the prefix is found from the .pc file's own directory, so
# `cmake --install build --prefix P` works for any P.
set(HP_PC_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
file(RELATIVE_PATH HP_PC_PREFIX_FROM_PCDIR
  ${CMAKE_INSTALL_PREFIX}/${HP_PC_INSTALL_DIR} ${CMAKE_INSTALL_PREFIX})
string(REGEX REPLACE "/$" "" HP_PC_PREFIX_FROM_PCDIR "${HP_PC_PREFIX_FROM_PCDIR}")
# Static layer libraries, each before the layers it uses.
set(HP_PC_LAYER_LIBS)
foreach(layer train model plan tp hsdp moe cp attention comm common)
  string(APPEND HP_PC_LAYER_LIBS " -lhp_${layer}")
endforeach()
string(STRIP "${HP_PC_LAYER_LIBS}" HP_PC_LAYER_LIBS)
# LibTorch: its include directories and compile definitions (transitive, from its imported
# targets) and flags; libtorch/libtorch_cpu linked even when no symbol is referenced directly
# (operator registration), as LibTorch's own CMake targets do.
set(HP_PC_TORCH_CFLAGS)
foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
  if(NOT dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES AND NOT dir STREQUAL "/usr/include")
    string(APPEND HP_PC_TORCH_CFLAGS " -I${dir}")
  endif()
endforeach()
set(_hp_defs "$<TARGET_PROPERTY:hp,INTERFACE_COMPILE_DEFINITIONS>")
string(APPEND HP_PC_TORCH_CFLAGS
  " $<$<BOOL:${_hp_defs}>:-D$<JOIN:${_hp_defs}, -D>> ${TORCH_CXX_FLAGS} ${OpenMP_CXX_FLAGS} -pthread")
string(STRIP "${HP_PC_TORCH_CFLAGS}" HP_PC_TORCH_CFLAGS)
get_filename_component(_hp_torch_libdir "${TORCH_LIBRARY}" DIRECTORY)
set(HP_PC_TORCH_LIBS
  "-L${_hp_torch_libdir} -Wl,--no-as-needed -ltorch -ltorch_cpu -Wl,--as-needed -lc10 ${OpenMP_CXX_FLAGS} -pthread")
foreach(lib IN LISTS CMAKE_DL_LIBS)
  string(APPEND HP_PC_TORCH_LIBS " -l${lib}")
endforeach()
configure_file(cmake/hyperparallel.pc.in ${PROJECT_BINARY_DIR}/hyperparallel.pc.gen @ONLY)
file(GENERATE OUTPUT ${PROJECT_BINARY_DIR}/hyperparallel.pc
  INPUT ${PROJECT_BINARY_DIR}/hyperparallel.pc.gen)
install(FILES ${PROJECT_BINARY_DIR}/hyperparallel.pc DESTINATION ${HP_PC_INSTALL_DIR})
