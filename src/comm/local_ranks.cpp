#include "hp/comm/local_ranks.h"

#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "hp/common/check.h"
#include "hp/common/threads.h"

namespace hp::comm {

void run_thread_ranks(int n, const std::function<void(World&)>& fn, const WorldOptions& options) {
  HP_CHECK(n >= 1, "run_thread_ranks: n=", n, " must be >= 1");
  common::configure_threads(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(options.timeout);
  std::mutex mu;
  std::exception_ptr first;
  int first_rank = -1;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto opts = options;
        // Each rank records into its own recorder; a shared tracer is fine (thread-safe).
        if (options.recorder) opts.recorder = std::make_shared<CollectiveRecorder>();
        auto world = World::in_process(r, n, store, opts);
        fn(world);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) {
          first = std::current_exception();
          first_rank = r;
        }
      }
    });
  }
  for (auto& t : threads)
    t.join();
  if (first) {
    try {
      std::rethrow_exception(first);
    } catch (const std::exception& e) {
      throw Error(common::str_cat("rank ", first_rank, " of ", n, ": ", e.what()));
    }
  }
}

}  // namespace hp::comm
