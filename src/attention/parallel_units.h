// Internal to attention/: a kernel's own parallel loop over independent units of work (one
// BLAS call per unit, BLAS pinned to one thread by the caller: common::ScopedBlasThreads).
#pragma once

#include <atomic>
#include <cstdint>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

namespace hp::attention::detail {

// Makes sure `threads` BLAS calls running at once find their BLAS work buffers already
// touched. OpenBLAS hands each concurrent call one buffer from a process-wide table (first
// free slot) and its Zen sgemm kernel prefetches ahead into that buffer: while those pages have
// never been written, every prefetch takes a failed page walk, and GEMMs with a short inner
// dimension (the [256 x 64] x [64 x 256] tiles of attention) ran at a third of their rate
// (10-12 instead of 31-34 GFLOP/s on one core) until some larger GEMM had touched the
// buffer. One 512^3 GEMM per slot, run on `threads` threads at once so each takes its own
// slot, touches them for good. Done once per process for the largest `threads` asked (the
// only process-wide state of the kernels: a cache of a side effect; thread-safe). Cheap
// (about 8 ms per thread, once) and harmless with other BLAS libraries.
void warm_blas_buffers(int threads);

// fn(unit, slot) for unit in [0, n) over `threads` slots; a slot is one thread's (its scratch
// buffers are its own). Units are handed out dynamically, so uneven units balance.
template <typename Fn>
void for_each_unit(int64_t n, int threads, const Fn& fn) {
  warm_blas_buffers(threads);
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
