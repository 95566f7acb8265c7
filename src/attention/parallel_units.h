// Internal to attention/: a kernel's own parallel loop over independent units of work (one
// BLAS call per unit, BLAS pinned to one thread by the caller: common::ScopedBlasThreads).
#pragma once

#include <atomic>
#include <cstdint>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

namespace hp::attention::detail {

// fn(unit, slot) for unit in [0, n) over `threads` slots; a slot is one thread's (its scratch
// buffers are its own). Units are handed out dynamically, so uneven units balance.
template <typename Fn>
void for_each_unit(int64_t n, int threads, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    // Worker threads do not inherit the caller's grad mode: the kernels work on raw data.
    at::NoGradGuard no_grad;
    for (int64_t slot = begin; slot < end; ++slot) {
      for (int64_t u = next++; u < n; u = next++)
        fn(u, slot);
    }
  });
}

}  // namespace hp::attention::detail
