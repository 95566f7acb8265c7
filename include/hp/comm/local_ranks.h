// Threads as ranks: n threads in this process, one shared in-memory store, loopback Gloo.
// For tools that run a small job in one process (hp-cp-run) and for the test harness.
#pragma once

#include <functional>

#include "hp/comm/world.h"

namespace hp::comm {

// Runs fn(world) on n threads (rank = thread index) and waits for all. The first rank failure
// is rethrown as hp::Error("rank r of n: ..."); the others fail within the group timeout.
// Sets one intra-op thread for the process (the rank threads share the cores).
void run_thread_ranks(int n, const std::function<void(World&)>& fn,
                      const WorldOptions& options = {});

}  // namespace hp::comm
