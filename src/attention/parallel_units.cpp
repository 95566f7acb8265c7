// See parallel_units.h: touching the BLAS library's per-call work buffers once per process.
#include "parallel_units.h"

#include <mutex>

#include <ATen/ATen.h>

namespace hp::attention::detail {

void warm_blas_buffers(int threads) {
  static std::mutex mutex;
  static int warmed = 0;  // slots already touched
  std::lock_guard<std::mutex> lock(mutex);
  if (threads <= warmed) return;
  constexpr int64_t kSide = 512;  // 384 was the smallest that touched enough on OpenBLAS 0.3.21
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    for (int64_t i = begin; i < end; ++i) {
      auto a = at::ones({kSide, kSide}, at::kFloat);
      at::mm(a, a);
    }
  });
  warmed = threads;
}

}  // namespace hp::attention::detail
