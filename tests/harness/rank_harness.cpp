#include "rank_harness.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/launcher.h"
#include "hp/comm/local_ranks.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"

namespace hp::testing {

namespace {

comm::WorldOptions world_options(const RankOptions& o) {
  comm::WorldOptions wo;
  wo.timeout = o.timeout;
  wo.verify_shapes = o.verify_shapes;
  wo.tracer = o.tracer;
  if (o.record) wo.recorder = std::make_shared<comm::CollectiveRecorder>();
  return wo;
}

}  // namespace

void run_ranks(int n, const std::function<void(comm::World&)>& fn, const RankOptions& options) {
  comm::run_thread_ranks(n, fn, world_options(options));
}

std::vector<ProcessResult> run_rank_processes(int n, const std::function<void(comm::World&)>& fn,
                                              const RankOptions& options,
                                              std::chrono::milliseconds deadline) {
  const int port = comm::pick_free_port();
  std::vector<pid_t> pids(n);
  std::vector<int> pipes(n);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < n; ++r) {
    int fds[2];
    HP_CHECK(::pipe(fds) == 0, "pipe failed");
    pid_t pid = ::fork();
    HP_CHECK(pid >= 0, "fork failed");
    if (pid == 0) {
      ::close(fds[0]);
      common::configure_threads(1);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      int code = 0;
      std::string err;
      try {
        auto world = comm::World::from_env(world_options(options));
        fn(world);
      } catch (const std::exception& e) {
        err = e.what();
        code = 1;
      }
      if (!err.empty()) {
        ssize_t unused = ::write(fds[1], err.data(), err.size());
        (void)unused;
      }
      ::close(fds[1]);
      ::_exit(code);
    }
    ::close(fds[1]);
    pids[r] = pid;
    pipes[r] = fds[0];
  }
  std::vector<ProcessResult> results(n);
  std::vector<bool> done(n, false);
  int remaining = n;
  while (remaining > 0) {
    const bool late = std::chrono::steady_clock::now() - start > deadline;
    for (int r = 0; r < n; ++r) {
      if (done[r]) continue;
      if (late) ::kill(pids[r], SIGKILL);
      int status = 0;
      if (::waitpid(pids[r], &status, late ? 0 : WNOHANG) != pids[r]) continue;
      done[r] = true;
      --remaining;
      auto& res = results[r];
      res.rank = r;
      res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (WIFEXITED(status)) res.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) res.term_signal = WTERMSIG(status);
      char buf[4096];
      ssize_t k;
      while ((k = ::read(pipes[r], buf, sizeof(buf))) > 0)
        res.error.append(buf, k);
      ::close(pipes[r]);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return results;
}

CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  HP_CHECK(p != nullptr, "run_command: cannot start ", cmd);
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0)
    r.out.append(buf, n);
  r.rc = WEXITSTATUS(::pclose(p));
  return r;
}

const std::string& scratch_dir() {
  struct Dir {
    std::string path;
    Dir() : path(::testing::TempDir() + "hp-test-" + std::to_string(::getpid())) {
      std::filesystem::remove_all(path);  // a leftover of a process with the same pid
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const hp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                  double rtol, double atol) {
  ASSERT_TRUE(actual.defined()) << what << ": actual is undefined";
  ASSERT_TRUE(expected.defined()) << what << ": expected is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what << ": shape mismatch";
  auto a = actual.to(at::kDouble);
  auto e = expected.to(at::kDouble);
  if (at::allclose(a, e, rtol, atol)) return;
  auto err = (a - e).abs() - rtol * e.abs();
  auto idx = err.flatten().argmax().item<int64_t>();
  ADD_FAILURE() << what << ": not close (rtol=" << rtol << ", atol=" << atol
                << "); worst flat index " << idx << ": actual " << a.flatten()[idx].item<double>()
                << " vs expected " << e.flatten()[idx].item<double>() << ", max abs diff "
                << (a - e).abs().max().item<double>();
}

}  // namespace hp::testing
