#include "hp/comm/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "hp/common/check.h"
#include "hp/common/threads.h"

namespace hp::comm {
namespace {

// Set by the signal handler only; the one piece of process-wide state a signal needs.
volatile sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  g_stop_signal = sig;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return common::str_cat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return common::str_cat("was killed by signal ", WTERMSIG(status), " (",
                           strsignal(WTERMSIG(status)), ")");
  }
  return "ended abnormally";
}

}  // namespace

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  HP_CHECK(fd >= 0, "pick_free_port: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  HP_CHECK(ok, "pick_free_port: cannot bind a port on 127.0.0.1: ", std::strerror(errno));
  return ntohs(addr.sin_port);
}

std::string self_executable() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  HP_CHECK(n > 0, "self_executable: cannot read /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

int relaunch_as_local_ranks(int nproc, const std::vector<std::string>& argv,
                            const std::string& tool) {
  LaunchOptions lo;
  lo.nproc = nproc;
  lo.argv = argv;
  lo.argv[0] = self_executable();
  auto res = launch_local_ranks(lo);
  if (res.exit_code != 0) std::fprintf(stderr, "%s: %s\n", tool.c_str(), res.message.c_str());
  return res.exit_code;
}

void report_rank_error(const std::string& what) {
  const char* path = std::getenv("HP_ERROR_FILE");
  if (path == nullptr) return;
  std::ofstream f(path);
  f << what;
}

LaunchResult launch_local_ranks(const LaunchOptions& o) {
  HP_CHECK(o.nproc >= 1, "launch: nproc=", o.nproc, " must be >= 1");
  HP_CHECK(!o.argv.empty(), "launch: no command given");
  const int port = o.master_port > 0 ? o.master_port : pick_free_port();
  const int threads =
      o.threads_per_rank > 0 ? o.threads_per_rank : common::threads_per_rank(o.nproc);
  const auto err_dir =
      std::filesystem::temp_directory_path() / common::str_cat("hp-launch-", ::getpid(), "-", port);
  std::filesystem::create_directories(err_dir);

  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  g_stop_signal = 0;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);

  std::vector<pid_t> pids(o.nproc, -1);
  std::vector<bool> alive(o.nproc, false);
  for (int r = 0; r < o.nproc; ++r) {
    pid_t pid = ::fork();
    HP_CHECK(pid >= 0, "launch: fork failed for rank ", r, ": ", std::strerror(errno));
    if (pid == 0) {
      // Child: default signal handling, rank environment, exec.
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      auto set = [](const std::string& k, const std::string& v) {
        ::setenv(k.c_str(), v.c_str(), 1);
      };
      set("RANK", std::to_string(r));
      set("WORLD_SIZE", std::to_string(o.nproc));
      set("LOCAL_RANK", std::to_string(r));
      set("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
      set("MASTER_ADDR", o.master_addr);
      set("MASTER_PORT", std::to_string(port));
      set("HP_ERROR_FILE", (err_dir / common::str_cat("rank", r, ".err")).string());
      for (const auto& [k, v] : common::child_thread_env(threads))
        set(k, v);
      for (const auto& [k, v] : o.extra_env)
        set(k, v);
      std::vector<char*> args;
      for (const auto& a : o.argv)
        args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::fprintf(stderr, "launch: exec of %s failed for rank %d: %s\n", args[0], r,
                   std::strerror(errno));
      ::_exit(127);
    }
    pids[r] = pid;
    alive[r] = true;
  }

  LaunchResult result;
  int remaining = o.nproc;
  auto teardown_started = std::chrono::steady_clock::time_point{};
  bool tearing_down = false;
  bool killed = false;
  auto start_teardown = [&] {
    if (tearing_down) return;
    tearing_down = true;
    teardown_started = std::chrono::steady_clock::now();
    for (int r = 0; r < o.nproc; ++r) {
      if (alive[r]) ::kill(pids[r], SIGTERM);
    }
  };
  while (remaining > 0) {
    bool reaped = false;
    for (int r = 0; r < o.nproc; ++r) {
      if (!alive[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      reaped = true;
      alive[r] = false;
      --remaining;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && result.failed_rank < 0 && !tearing_down) {
        result.failed_rank = r;
        result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        std::string err = read_file((err_dir / common::str_cat("rank", r, ".err")).string());
        result.message =
            common::str_cat("rank ", r, " (pid ", pids[r], ") ", describe_status(status),
                            err.empty() ? "" : ": ", err, "; stopped the other ranks");
        start_teardown();
      }
    }
    if (reaped) continue;
    if (g_stop_signal != 0 && !tearing_down) {
      result.exit_code = 128 + g_stop_signal;
      result.message = common::str_cat("interrupted by signal ", static_cast<int>(g_stop_signal),
                                       "; stopped all ranks");
      start_teardown();
    }
    if (tearing_down && !killed && std::chrono::steady_clock::now() - teardown_started > o.grace) {
      for (int r = 0; r < o.nproc; ++r) {
        if (alive[r]) ::kill(pids[r], SIGKILL);
      }
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  std::error_code ec;
  std::filesystem::remove_all(err_dir, ec);
  return result;
}

}  // namespace hp::comm
