# Precompiled LibTorch headers (HP_PCH, default ON). Parsing ATen and the autograd headers is
# about 7-11 s of every translation unit on a 2-core CI machine, and nearly every one of ours
# includes them (through include/hp); a precompiled header loads in about 2.5 s. GCC accepts a
# .gch only where it was built with the same -fPIC/-fPIE and target options, so there is one per
# kind, built by the first target of that kind and reused by the rest:
#   lib   the layer libraries, the bench library and the test harness (-fPIC)
#   exe   the tools and standalone benches (-fPIE)
#   test  the gtest suites (-fPIE; gtest's header too)
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
  if(kind STREQUAL "test")
    list(APPEND headers <gtest/gtest.h>)
  endif()
  target_precompile_headers(${target} PRIVATE ${headers})
  set_property(GLOBAL PROPERTY HP_PCH_OWNER_${kind} ${target})
endfunction()
