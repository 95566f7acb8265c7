// Multi-rank test harness.
//   run_ranks(n, fn)           n threads as ranks, one HashStore, loopback Gloo, short timeouts;
//                              the first rank failure is rethrown on the test thread.
//   run_rank_processes(n, fn)  n forked processes rendezvousing through a TCPStore via the
//                              torchrun variables (World::from_env), for crash/timeout tests.
//   expect_close(...)          fp comparison with a readable failure.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/comm/traffic.h"
#include "hp/comm/world.h"
#include "hp/common/trace.h"

namespace hp::testing {

struct RankOptions {
  std::chrono::milliseconds timeout{20000};
  bool verify_shapes = true;
  // Shared by all rank threads when set (one file, one track per rank).
  std::shared_ptr<common::Tracer> tracer;
  // Gives each rank its own recorder (World::context().recorder).
  bool record = true;
};

void run_ranks(int n, const std::function<void(comm::World&)>& fn, const RankOptions& options = {});

struct ProcessResult {
  int rank = 0;
  int exit_code = -1;  // -1 when killed by a signal
  int term_signal = 0;
  std::string error;   // what the rank's fn threw, if anything
  double seconds = 0;  // wall time until the process ended
};

// Each child: one intra-op thread, World::from_env, fn(world); exit 0 on success, 1 with the
// error text on an exception. Children still alive at `deadline` are killed (SIGKILL) and
// reported with term_signal set.
std::vector<ProcessResult> run_rank_processes(
    int n, const std::function<void(comm::World&)>& fn, const RankOptions& options = {},
    std::chrono::milliseconds deadline = std::chrono::seconds(60));

// Runs a shell command; its exit code and its stdout + stderr.
struct CommandResult {
  int rc = -1;
  std::string out;
};
CommandResult run_command(const std::string& cmd);

// A directory of this test process's own under ::testing::TempDir() (created on first use,
// removed when the process exits), so concurrent runs of a suite (several worktrees, ctest -j)
// never share or delete each other's files. Ends without a slash.
const std::string& scratch_dir();

// The message of the hp::Error `fn` throws, or "(no error)".
std::string error_of(const std::function<void()>& fn);

// Expects `stmt` to throw an hp::Error whose message contains `text`.
#define HP_EXPECT_ERROR(stmt, text)                                     \
  do {                                                                  \
    const std::string hp_msg_ = ::hp::testing::error_of([&] { stmt; }); \
    EXPECT_NE(hp_msg_.find(text), std::string::npos) << hp_msg_;        \
  } while (false)

// Same shape and allclose(rtol, atol); the message names `what` and the worst element.
void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                  double rtol = 1e-5, double atol = 1e-5);

}  // namespace hp::testing
