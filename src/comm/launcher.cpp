// The local launcher (launcher.h).
//
//   launcher (tool with --nproc N, or a test)          rank processes 0..N-1
//     TCPStore server on master_addr only  <──────────  clients (HP_STORE_ON_LAUNCHER=1);
//                                                        each World's thread writes
//                                                        hp/heartbeat/<rank> every 250 ms
//     memfd per rank (its error report)  ─────────────> HP_ERROR_FILE=/proc/self/fd/<fd>
//     fork + execve, environment built before fork ───> PR_SET_PDEATHSIG(SIGKILL), same pgrp
//     poll: waitpid(WNOHANG) every 20 ms, heartbeats every 200 ms
//     first failure -> `settle` (collect the consequences) -> blame -> SIGTERM (+SIGCONT) the
//     others -> SIGKILL after `grace`
//     SIGINT / SIGTERM / SIGHUP -> the same teardown, exit 128 + signal
//   On every exit path (return, exception) the ranks still alive are killed and reaped.
#include "hp/comm/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "heartbeat.h"
#include "hp/comm/store.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"

extern char** environ;

namespace hp::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Set by the signal handler only; the one piece of process-wide state a signal needs.
volatile sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  g_stop_signal = sig;
}

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr int kNumStopSignals = sizeof(kStopSignals) / sizeof(kStopSignals[0]);

// The launcher's handlers for kStopSignals while it runs; the previous ones come back on every
// exit path.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < kNumStopSignals; ++i)
      sigaction(kStopSignals[i], &sa, &old_[i]);
  }
  ~StopSignals() {
    for (int i = 0; i < kNumStopSignals; ++i)
      sigaction(kStopSignals[i], &old_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_[kNumStopSignals];
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return common::str_cat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return common::str_cat("was killed by signal ", WTERMSIG(status), " (",
                           strsignal(WTERMSIG(status)), ")");
  }
  return "ended abnormally";
}

// First line of a rank's error file when its error was a communication failure (hp::CommError):
// most likely the consequence of a peer's failure, not the cause.
constexpr char kCommErrorTag[] = "hp-error-kind: comm\n";
// ... when it was one of hyperparallel's own checks (hp::Error, not a CommError): the program
// refused its options or inputs, which a restart of the same command repeats.
constexpr char kCheckErrorTag[] = "hp-error-kind: check\n";

constexpr std::chrono::milliseconds kHeartbeatPoll{200};

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' stopped, 't' traced, 'D', ...), 0 if none.
char process_state(pid_t pid) {
  std::ifstream f(common::str_cat("/proc/", pid, "/stat"));
  const std::string stat((std::istreambuf_iterator<char>(f)), {});
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return 0;
  return stat[close + 2];
}

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

int exit_code_of(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The whole content of the anonymous file `fd`.
std::string read_all(int fd) {
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || st.st_size <= 0) return "";
  std::string s(static_cast<size_t>(st.st_size), '\0');
  const ssize_t n = ::pread(fd, s.data(), s.size(), 0);
  s.resize(n > 0 ? static_cast<size_t>(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' '))
    s.pop_back();
  return s;
}

// This process's environment with `set` applied ("NAME=value" strings).
std::vector<std::string> environment_with(
    const std::vector<std::pair<std::string, std::string>>& set) {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv(*e);
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : set)
    env[k] = v;
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env)
    out.push_back(std::string(k).append("=").append(v));
  return out;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings)
    out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  int error_fd = -1;  // the rank's error report (memfd), read once it ended
  bool alive = false;
  int status = 0;
  Clock::time_point ended;   // when the launcher reaped it
  std::string error;         // its report, without the tag
  bool comm_error = false;   // the report was tagged as a communication failure
  bool check_error = false;  // ... as one of the program's own checks (repeats on a restart)
  // Its heartbeat as the launcher last read it, and when that value first appeared.
  std::string beat;
  Clock::time_point beat_changed;
  int64_t ops = -1;  // collectives launched, from the heartbeat

  bool failed() const {
    return !alive && pid > 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
};

// One run of all ranks. The destructor kills (SIGKILL) and reaps any rank still alive and
// closes the error files, so no exit path leaves a rank behind.
class Attempt {
 public:
  Attempt(const LaunchOptions& o, std::vector<std::string> argv) : o_(o), argv_(std::move(argv)) {}
  ~Attempt() {
    for (auto& r : ranks_) {
      if (r.alive) {
        ::kill(r.pid, SIGKILL);
        ::waitpid(r.pid, &r.status, 0);
        r.alive = false;
      }
      if (r.error_fd >= 0) ::close(r.error_fd);
    }
  }
  Attempt(const Attempt&) = delete;
  Attempt& operator=(const Attempt&) = delete;

  LaunchResult run();

 private:
  void spawn(int rank, int port, int threads);
  int reap();  // reaps ended ranks; returns the number still alive
  void read_heartbeats();
  LaunchResult blame() const;
  std::string stopped_making_progress(const RankProcess& r, Clock::time_point now) const;
  void teardown();

  const LaunchOptions& o_;
  std::vector<std::string> argv_;
  c10::intrusive_ptr<c10d::TCPStore> store_;  // the job's; destroyed after the ranks ended
  std::vector<RankProcess> ranks_;
};

void Attempt::spawn(int rank, int port, int threads) {
  RankProcess& r = ranks_[rank];
  r.rank = rank;
  r.error_fd = ::memfd_create("hp-rank-error", MFD_CLOEXEC);
  HP_CHECK(r.error_fd >= 0, "launch: memfd_create failed for rank ", rank, ": ",
           std::strerror(errno));
  std::vector<std::pair<std::string, std::string>> set{
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(o_.nproc)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc)},
      {"MASTER_ADDR", o_.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"HP_ERROR_FILE", common::str_cat("/proc/self/fd/", r.error_fd)},
      {"HP_STORE_ON_LAUNCHER", "1"}};
  for (const auto& kv : common::child_thread_env(threads))
    set.push_back(kv);
  for (const auto& kv : o_.extra_env)
    set.push_back(kv);
  // Everything the child needs is built here: between fork and exec it may only make
  // async-signal-safe calls (the launcher can have threads, e.g. LibTorch's).
  auto env = environment_with(set);
  auto envp = c_strings(env);
  auto args = argv_;
  auto argvp = c_strings(args);
  const std::string exec_failed =
      common::str_cat("launch: exec of ", argv_[0], " failed for rank ", rank, "\n");
  const pid_t parent = ::getpid();
  const int fd = r.error_fd;
  const pid_t pid = ::fork();
  HP_CHECK(pid >= 0, "launch: fork failed for rank ", rank, ": ", std::strerror(errno));
  if (pid == 0) {
    for (int s : kStopSignals)
      ::signal(s, SIG_DFL);
    // Die with the launcher, however it ends (kill -9 included).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(128 + SIGKILL);  // it ended before prctl
    ::fcntl(fd, F_SETFD, 0);                            // the error file survives exec
    ::execve(argvp[0], argvp.data(), envp.data());
    const ssize_t unused = ::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    (void)unused;
    ::_exit(127);
  }
  r.pid = pid;
  r.alive = true;
}

int Attempt::reap() {
  int alive = 0;
  for (auto& r : ranks_) {
    if (!r.alive) continue;
    if (::waitpid(r.pid, &r.status, WNOHANG) == r.pid) {
      r.alive = false;
      r.ended = Clock::now();
      r.error = read_all(r.error_fd);
      if (r.error.rfind(kCommErrorTag, 0) == 0) {
        r.comm_error = true;
        r.error.erase(0, sizeof(kCommErrorTag) - 1);
      } else if (r.error.rfind(kCheckErrorTag, 0) == 0) {
        r.check_error = true;
        r.error.erase(0, sizeof(kCheckErrorTag) - 1);
      }
    } else {
      ++alive;
    }
  }
  return alive;
}

// SIGTERM (and SIGCONT, for a stopped rank) to every rank still alive; SIGKILL after `grace`.
void Attempt::teardown() {
  for (auto& r : ranks_) {
    if (!r.alive) continue;
    ::kill(r.pid, SIGTERM);
    ::kill(r.pid, SIGCONT);
  }
  const auto start = Clock::now();
  bool killed = false;
  while (reap() > 0) {
    if (!killed && Clock::now() - start > o_.grace) {
      for (auto& r : ranks_) {
        if (r.alive) ::kill(r.pid, SIGKILL);
      }
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void Attempt::read_heartbeats() {
  const auto now = Clock::now();
  for (auto& r : ranks_) {
    try {
      const std::string key = detail::heartbeat_key(r.rank);
      if (!store_->check({key})) continue;
      const auto v = store_->get(key);
      std::string beat(v.begin(), v.end());
      if (beat == r.beat) continue;
      r.beat = std::move(beat);
      r.beat_changed = now;
      const auto space = r.beat.find(' ');
      if (space != std::string::npos) r.ops = std::atoll(r.beat.c_str() + space + 1);
    } catch (const std::exception&) {
      // a heartbeat is evidence, never a reason to fail
    }
  }
}

// Why `r`, alive, counts as the rank that stopped; empty when it does not: its process is
// stopped, or its heartbeat has not changed for kHeartbeatStale.
std::string Attempt::stopped_making_progress(const RankProcess& r, Clock::time_point now) const {
  const char state = process_state(r.pid);
  const bool stopped = state == 'T' || state == 't';
  const bool stale = !r.beat.empty() && now - r.beat_changed > detail::kHeartbeatStale;
  if (!stopped && !stale) return "";
  char age[32];
  std::snprintf(age, sizeof(age), "%.1f", seconds(now - r.beat_changed));
  std::string why = r.beat.empty() ? std::string("it never sent a heartbeat")
                                   : common::str_cat("no heartbeat for ", age, " s");
  if (stopped) why += state == 'T' ? " (its process is stopped, e.g. by SIGSTOP)" : " (traced)";
  return why;
}

// The rank that failed first (launcher.h): killed by a signal; stopped making progress (alive,
// process stopped or heartbeat stale, or the only one behind in collectives launched); failed
// with its own error; failed earliest.
LaunchResult Attempt::blame() const {
  const auto now = Clock::now();
  std::vector<const RankProcess*> failed;
  for (const auto& r : ranks_) {
    if (r.failed()) failed.push_back(&r);
  }
  std::stable_sort(failed.begin(), failed.end(),
                   [](const RankProcess* a, const RankProcess* b) { return a->ended < b->ended; });
  auto describe = [](const RankProcess& r) {
    return common::str_cat("rank ", r.rank, " (pid ", r.pid, ") ", describe_status(r.status),
                           r.error.empty() ? "" : ": ", r.error);
  };
  LaunchResult res;
  const RankProcess* primary = nullptr;
  std::string hung_because;
  for (const auto* r : failed) {
    if (WIFSIGNALED(r->status)) {
      primary = r;
      break;
    }
  }
  if (primary == nullptr) {
    double worst = -1;
    for (const auto& r : ranks_) {
      if (!r.alive) continue;
      auto why = stopped_making_progress(r, now);
      const double age = r.beat.empty() ? 0 : seconds(now - r.beat_changed);
      if (!why.empty() && age > worst) {
        primary = &r;
        hung_because = why;
        worst = age;
      }
    }
  }
  if (primary == nullptr) {
    for (const auto* r : failed) {
      if (!r->comm_error) {
        primary = r;
        break;
      }
    }
  }
  if (primary == nullptr) {
    // Every failure is a communication error: a live rank that launched fewer collectives than
    // every other rank is the one they waited for.
    const RankProcess* behind = nullptr;
    int64_t others = -1;
    for (const auto& r : ranks_) {
      if (!r.alive || r.ops < 0) continue;
      bool lowest = true;
      int64_t most = -1;
      for (const auto& q : ranks_) {
        if (&q == &r) continue;
        if (q.ops >= 0 && q.ops <= r.ops) lowest = false;
        most = std::max(most, q.ops);
      }
      if (lowest && most > r.ops) {
        behind = &r;
        others = most;
      }
    }
    if (behind != nullptr) {
      primary = behind;
      hung_because = common::str_cat("it launched ", behind->ops, " collectives, the others up to ",
                                     others, " (it never reached the one they waited in)");
    }
  }
  if (primary == nullptr) primary = failed.front();
  res.failed_rank = primary->rank;
  res.check_error = hung_because.empty() && primary->check_error;
  if (!hung_because.empty()) {
    const RankProcess& first = *failed.front();
    res.exit_code = exit_code_of(first.status);
    res.message = common::str_cat("rank ", primary->rank, " (pid ", primary->pid,
                                  ") stopped making progress: ", hung_because, "; then ",
                                  describe(first), "; stopped the other ranks");
  } else {
    res.exit_code = exit_code_of(primary->status);
    res.message = describe(*primary) + "; stopped the other ranks";
  }
  return res;
}

LaunchResult Attempt::run() {
  LaunchResult result;
  // The job's store lives here, not in rank 0: it outlives any rank, and its heartbeats show
  // which rank stopped.
  StoreServerOptions so;
  so.bind_address = o_.master_addr;
  so.port = o_.master_port;
  so.timeout = o_.store_timeout;
  store_ = serve_store(so);
  const int port = store_->getPort();
  const int threads =
      o_.threads_per_rank > 0 ? o_.threads_per_rank : common::threads_per_rank(o_.nproc);
  ranks_.resize(o_.nproc);
  for (int r = 0; r < o_.nproc; ++r)
    spawn(r, port, threads);
  bool failed = false;
  auto first_failure = Clock::time_point{};
  auto last_read = Clock::time_point{};
  while (true) {
    if (g_stop_signal != 0) {
      result.exit_code = 128 + g_stop_signal;
      result.interrupted = true;
      result.message = common::str_cat("interrupted by signal ", static_cast<int>(g_stop_signal),
                                       "; stopped all ranks");
      teardown();
      return result;
    }
    const int alive = reap();
    const auto now = Clock::now();
    if (now - last_read >= kHeartbeatPoll) {
      read_heartbeats();
      last_read = now;
    }
    if (!failed) {
      failed = std::any_of(ranks_.begin(), ranks_.end(),
                           [](const RankProcess& r) { return r.failed(); });
      first_failure = now;
    }
    // After the first failure, wait `settle` for its consequences before naming a rank.
    if (failed && (alive == 0 || now - first_failure >= o_.settle)) {
      read_heartbeats();
      result = blame();
      teardown();
      return result;
    }
    if (alive == 0) return result;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
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
  return relaunch_as_local_ranks(std::move(lo), tool);
}

int relaunch_as_local_ranks(LaunchOptions lo, const std::string& tool) {
  const std::string self = self_executable();
  if (!lo.argv.empty()) lo.argv[0] = self;
  if (lo.argv_for_attempt) {
    lo.argv_for_attempt = [self, given = lo.argv_for_attempt](int attempt) {
      auto argv = given(attempt);
      if (!argv.empty()) argv[0] = self;
      return argv;
    };
  }
  if (!lo.log) {
    lo.log = [tool](const std::string& line) {
      std::fprintf(stderr, "%s: %s\n", tool.c_str(), line.c_str());
      std::fflush(stderr);
    };
  }
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

void report_rank_error(const std::exception& error) {
  const bool comm = dynamic_cast<const hp::CommError*>(&error) != nullptr;
  const bool check = !comm && dynamic_cast<const hp::Error*>(&error) != nullptr;
  // LibTorch's errors carry a backtrace; the launcher's one-line summary quotes the message.
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  report_rank_error(std::string(comm    ? kCommErrorTag
                                : check ? kCheckErrorTag
                                        : "") +
                    (c10_error != nullptr ? c10_error->what_without_backtrace() : error.what()));
}

LaunchResult launch_local_ranks(const LaunchOptions& o) {
  HP_CHECK(o.nproc >= 1, "launch: nproc=", o.nproc, " must be >= 1");
  HP_CHECK(o.max_restarts >= 0, "launch: max_restarts=", o.max_restarts, " must be >= 0");
  StopSignals signals;
  for (int attempt = 0;; ++attempt) {
    const auto argv = o.argv_for_attempt ? o.argv_for_attempt(attempt) : o.argv;
    HP_CHECK(!argv.empty(), "launch: no command given",
             attempt > 0 ? common::str_cat(" for restart ", attempt) : std::string());
    LaunchResult result;
    if (g_stop_signal != 0) {  // between two runs
      result.exit_code = 128 + g_stop_signal;
      result.interrupted = true;
      result.message = common::str_cat(
          "interrupted by signal ", static_cast<int>(g_stop_signal),
          attempt == 0 ? std::string("; started no rank")
                       : common::str_cat(" before restart ", attempt, "; started no rank"));
    } else {
      Attempt run(o, argv);
      result = run.run();
    }
    result.restarts = attempt;
    if (result.exit_code == 0 || result.interrupted || attempt >= o.max_restarts) return result;
    if (result.check_error) {
      result.message += common::str_cat(
          "; not restarting (", o.max_restarts - attempt, " restart",
          o.max_restarts - attempt == 1 ? "" : "s",
          " left): the rank refused the run's own options or inputs, which a restart repeats");
      return result;
    }
    const std::string line = common::str_cat(result.message, "; restarting all ranks (restart ",
                                             attempt + 1, " of ", o.max_restarts, ")");
    if (o.log) {
      o.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }
}

}  // namespace hp::comm
