// Per-rank thread budgets: N ranks sharing C cores must not each start C BLAS/OpenMP threads.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace hp::common {

// Cores this process may use (sched affinity, falling back to hardware_concurrency).
int available_cores();

// Threads each of `ranks_on_node` ranks gets out of `cores` (0: available_cores()); at least 1.
int threads_per_rank(int ranks_on_node, int cores = 0);

// Sets intra-op threads of this process (at::set_num_threads) and OpenBLAS's pool size when
// OpenBLAS is the loaded BLAS. For threads-as-ranks, call with 1 before starting rank threads.
void configure_threads(int threads);

// Environment for a child rank process so its BLAS/OpenMP pools start at the right size
// (they read these once, at load time).
std::vector<std::pair<std::string, std::string>> child_thread_env(int threads);

// Pins OpenBLAS to `threads` for this scope and restores the previous count after. Kernels
// that run their own parallel loop (one BLAS call per thread) use it so two thread pools do
// not fight over the cores. OpenBLAS's count is process-wide: do not use it while another
// thread of the process expects multi-threaded BLAS. No-op when OpenBLAS is not loaded.
class ScopedBlasThreads {
 public:
  explicit ScopedBlasThreads(int threads);
  ~ScopedBlasThreads();
  ScopedBlasThreads(const ScopedBlasThreads&) = delete;
  ScopedBlasThreads& operator=(const ScopedBlasThreads&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace hp::common
