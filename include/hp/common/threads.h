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

}  // namespace hp::common
