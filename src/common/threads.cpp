#include "hp/common/threads.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <thread>

#include <ATen/Parallel.h>

#include "hp/common/check.h"

namespace hp::common {

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return std::max(1U, std::thread::hardware_concurrency());
}

int threads_per_rank(int ranks_on_node, int cores) {
  HP_CHECK(ranks_on_node >= 1, "threads_per_rank: ranks_on_node=", ranks_on_node, " must be >= 1");
  if (cores <= 0) cores = available_cores();
  return std::max(1, cores / ranks_on_node);
}

void configure_threads(int threads) {
  HP_CHECK(threads >= 1, "configure_threads: threads=", threads, " must be >= 1");
  at::set_num_threads(threads);
  // OpenBLAS keeps its own pool; resize it when OpenBLAS is what LibTorch calls into.
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(threads);
  }
}

namespace {
using SetFn = void (*)(int);
using GetFn = int (*)();
}  // namespace

ScopedBlasThreads::ScopedBlasThreads(int threads) {
  auto get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (get == nullptr || set == nullptr) return;
  previous_ = get();
  if (previous_ != threads) set(threads);
}

ScopedBlasThreads::~ScopedBlasThreads() {
  if (previous_ < 0) return;
  auto set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set != nullptr) set(previous_);
}

std::vector<std::pair<std::string, std::string>> child_thread_env(int threads) {
  const std::string n = std::to_string(std::max(1, threads));
  return {{"OPENBLAS_NUM_THREADS", n}, {"OMP_NUM_THREADS", n}, {"HP_NUM_THREADS", n}};
}

}  // namespace hp::common
