# cmake -P driver of the package test (see CMakeLists.txt here). Inputs: HP_BUILD_DIR,
# HP_CONSUMER_SOURCE_DIR, HP_WORK_DIR, HP_CXX_COMPILER, and optionally HP_CCACHE, HP_NINJA,
# HP_PKG_CONFIG (empty or *-NOTFOUND: not used / check skipped).
cmake_minimum_required(VERSION 3.18)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix ${HP_WORK_DIR}/prefix)
set(build ${HP_WORK_DIR}/consumer-build)
file(REMOVE_RECURSE ${HP_WORK_DIR})
file(MAKE_DIRECTORY ${HP_WORK_DIR})

# 1. Install into a scratch prefix.
run("install" ${CMAKE_COMMAND} --install ${HP_BUILD_DIR} --prefix ${prefix})
foreach(f include/hp/cp/apply.h include/hp/comm/launcher.h)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "install: ${prefix}/${f} missing")
  endif()
endforeach()
if(EXISTS ${prefix}/include/hp/bench)
  message(FATAL_ERROR "install: the benchmarks' headers are not part of the package")
endif()

# 2. Configure, build and run the consumer (Ninja and ccache when present: this is the slow
# part, one translation unit that includes LibTorch).
set(configure_args -S ${HP_CONSUMER_SOURCE_DIR} -B ${build}
  -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_COMPILER=${HP_CXX_COMPILER})
if(HP_NINJA)
  list(APPEND configure_args -G Ninja -DCMAKE_MAKE_PROGRAM=${HP_NINJA})
endif()
if(HP_CCACHE)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER_LAUNCHER=${HP_CCACHE})
endif()
run("configure consumer" ${CMAKE_COMMAND} ${configure_args})
run("build consumer" ${CMAKE_COMMAND} --build ${build})
run("run consumer" ${build}/consumer)
message(STATUS "${run_output}")

# 3. pkg-config: the flags name the installed include directory, and the consumer's object
# links and runs with them alone.
if(NOT HP_PKG_CONFIG)
  message(STATUS "pkg-config not found: hyperparallel.pc not checked")
  return()
endif()
file(GLOB pc_file ${prefix}/*/pkgconfig/hyperparallel.pc ${prefix}/*/*/pkgconfig/hyperparallel.pc)
if(NOT pc_file)
  message(FATAL_ERROR "install: no hyperparallel.pc under ${prefix}")
endif()
get_filename_component(pc_dir ${pc_file} DIRECTORY)
set(ENV{PKG_CONFIG_PATH} ${pc_dir})
run("pkg-config --cflags" ${HP_PKG_CONFIG} --cflags hyperparallel)
string(STRIP "${run_output}" cflags)
run("pkg-config --libs" ${HP_PKG_CONFIG} --libs hyperparallel)
string(STRIP "${run_output}" libs)
message(STATUS "cflags: ${cflags}\nlibs: ${libs}")
separate_arguments(cflags UNIX_COMMAND "${cflags}")
separate_arguments(libs UNIX_COMMAND "${libs}")
file(REAL_PATH ${prefix}/include want_include)
set(found_include FALSE)
foreach(flag IN LISTS cflags)
  if(flag MATCHES "^-I(.+)$")
    file(REAL_PATH "${CMAKE_MATCH_1}" dir)
    if(dir STREQUAL want_include)
      set(found_include TRUE)
    endif()
  endif()
endforeach()
if(NOT found_include)
  message(FATAL_ERROR "pkg-config --cflags does not name ${want_include}: ${cflags}")
endif()
# Every header resolves with the .pc's include flags (preprocessing only: cheap).
file(WRITE ${HP_WORK_DIR}/pc_include.cpp "#include <hp/cp/apply.h>\n#include <hp/common/torch_compat.h>\n")
run("preprocess with pkg-config flags"
  ${HP_CXX_COMPILER} -std=c++17 ${cflags} -E -o ${HP_WORK_DIR}/pc_include.ii ${HP_WORK_DIR}/pc_include.cpp)
file(GLOB_RECURSE object ${build}/CMakeFiles/consumer.dir/*main.cpp.o)
run("link with pkg-config flags"
  ${HP_CXX_COMPILER} -o ${HP_WORK_DIR}/consumer_pc ${object} ${libs})
run("run the pkg-config link" ${HP_WORK_DIR}/consumer_pc)
