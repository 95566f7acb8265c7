# Precompiled LibTorch headers (HP_PCH, default ON). Parsing ATen and the autograd headers is
# about 7-11 s of every translation unit on a 2-core CI machine, and nearly every one of ours
# includes them (through include/hp); a precompiled header loads in about 2.5 s. GCC accepts a
# .gch only where it was built with the same -fPIC/-fPIE and target options, so there is one per
# kind, reused by every target of that kind:
#   lib   the layer libraries, the bench library and the test harness (-fPIC); built by
#         hp_common, which every layer depends on anyway
#   exe   the tools and standalone benches (-fPIE)
#   test  the gtest suites (-fPIE; gtest's header too)
# exe and test are built by an object library of one empty source (hp_pch_exe, hp_pch_test),
# compiled as an executable's sources are: reusing a header makes a target wait for its owner,
# and an owning executable would have made every other one wait for its link (and a build of
# two suites, the ASan job's, build every layer that executable links).
# A TU whose own options differ (the hot loops' -O3 and math flags) skips it
# (SKIP_PRECOMPILE_HEADERS). The headers are force-included only into our own targets' TUs;
# include/hp still includes what it uses, and `-DHP_PCH=OFF` builds without any of this.
option(HP_PCH "Precompile LibTorch's headers for our targets (faster cold builds)" ON)

set(HP_PCH_HEADERS <ATen/ATen.h> <torch/csrc/autograd/custom_function.h>)

# hp_precompile(<target> <lib|exe|test>)
function(hp_precompile target kind)
  if(NOT HP_PCH)
    return()
  endif()
  get_property(owner GLOBAL PROPERTY HP_PCH_OWNER_${kind})
  if(owner)
    target_precompile_headers(${target} REUSE_FROM ${owner})
    return()
  endif()
  set(headers ${HP_PCH_HEADERS})
  set(owner ${target})
  if(NOT kind STREQUAL "lib")
    set(owner hp_pch_${kind})
    add_library(${owner} OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_owner.cpp)
    set_target_properties(${owner} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${owner} PRIVATE -fPIE ${HP_WARNINGS})
    target_link_libraries(${owner} PRIVATE ${TORCH_LIBRARIES} OpenMP::OpenMP_CXX)
    if(kind STREQUAL "test")
      list(APPEND headers <gtest/gtest.h>)
      target_link_libraries(${owner} PRIVATE GTest::gtest)
    endif()
  endif()
  target_precompile_headers(${owner} PRIVATE ${headers})
  set_property(GLOBAL PROPERTY HP_PCH_OWNER_${kind} ${owner})
  if(NOT owner STREQUAL target)
    target_precompile_headers(${target} REUSE_FROM ${owner})
  endif()
endfunction()
