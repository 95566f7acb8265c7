// The local launcher under faults, end to end through hp-train --nproc (issue 13, items 6-9 and
// --max-restarts): where the rendezvous listens, ranks dying with their launcher (kill -9,
// hang-up) and leaving no temporary files, the one default group timeout and the --timeout check,
// the summary naming the rank that failed or hung first, and restarts from the last checkpoint.
//
// Every job runs a tiny model for many steps with a seed of its own, so a process that outlives
// a test can be recognised by its command line and ended by its pid.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

// A small model that trains for as long as a test needs (it is always stopped or killed).
std::vector<std::string> long_run(int nproc, const std::string& seed) {
  return {HP_TRAIN_BINARY,
          "--nproc",
          std::to_string(nproc),
          "--cp",
          std::to_string(nproc),
          "--seq-len",
          "48",
          "--layers",
          "1",
          "--hidden",
          "24",
          "--heads",
          "3",
          "--kv-heads",
          "3",
          "--head-dim",
          "8",
          "--ffn",
          "32",
          "--steps",
          "100000",
          "--seed",
          seed};
}

// The process state letter of `pid` ('R', 'S', 'T', 'Z', ...), 0 when there is no such process.
char state_of(int pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  char state = 0;
  return std::sscanf(stat.c_str() + close + 1, " %c", &state) == 1 ? state : 0;
}

// Gone: no such process, or a zombie (an orphan's zombie may wait for a reaper that never comes).
bool gone(int pid) {
  const char s = state_of(pid);
  return s == 0 || s == 'Z' || s == 'X';
}

std::vector<int> children_of(int pid) {
  std::vector<int> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_file(e.path() / "stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) == 2 && ppid == pid &&
        state != 'Z') {
      out.push_back(std::stoi(name));
    }
  }
  return out;
}

// RANK=<r> from a process's environment, -1 when it has none.
int rank_of(int pid) {
  const std::string env = read_file("/proc/" + std::to_string(pid) + "/environ");
  std::istringstream in(env);
  std::string var;
  while (std::getline(in, var, '\0')) {
    if (var.rfind("RANK=", 0) == 0) return std::stoi(var.substr(5));
  }
  return -1;
}

// One hp-train job started in the background, its stdout and stderr in `log`.
struct Job {
  pid_t pid = -1;
  std::string log;
  std::string marker;        // a command-line argument only this job's processes have
  std::map<int, int> ranks;  // rank -> pid
  int status = -1;           // the launcher's wait status once it ended
  bool ended = false;

  std::string output() const { return read_file(log); }

  // Ends whatever is left of the job (launcher and survivors that still carry the marker).
  ~Job() {
    if (pid > 0 && !ended) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    for (const auto& [rank, rpid] : ranks) {
      const std::string cmdline = read_file("/proc/" + std::to_string(rpid) + "/cmdline");
      if (!gone(rpid) && cmdline.find(marker) != std::string::npos) ::kill(rpid, SIGKILL);
    }
  }
};

void start(Job& job, const std::vector<std::string>& args, const std::string& name,
           const std::vector<std::pair<std::string, std::string>>& env = {}) {
  job.log = hp::testing::scratch_dir() + "/" + name + ".log";
  job.marker = args.back();
  std::vector<std::string> a = args;
  std::vector<char*> argv;
  for (auto& s : a)
    argv.push_back(s.data());
  argv.push_back(nullptr);
  fs::remove(job.log);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(job.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    for (const auto& [k, v] : env)
      ::setenv(k.c_str(), v.c_str(), 1);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  job.pid = pid;
}

// Waits until the log contains `text` while the launcher runs; false after `seconds`.
bool wait_for_output(Job& job, const std::string& text, double seconds = 60) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < deadline) {
    if (job.output().find(text) != std::string::npos) return true;
    if (::waitpid(job.pid, &job.status, WNOHANG) == job.pid) {
      job.ended = true;
      return job.output().find(text) != std::string::npos;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Waits until rank 0 has trained its first step, then records the rank processes.
void wait_until_training(Job& job, int nproc) {
  ASSERT_TRUE(wait_for_output(job, "  step 1/")) << job.output();
  ASSERT_FALSE(job.ended) << job.output();
  for (int pid : children_of(job.pid)) {
    const int r = rank_of(pid);
    if (r >= 0) job.ranks[r] = pid;
  }
  ASSERT_EQ(job.ranks.size(), static_cast<size_t>(nproc)) << job.output();
}

// Waits for the launcher to end; false (and the launcher killed) after `seconds`.
bool wait_exit(Job& job, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (!job.ended && Clock::now() < deadline) {
    if (::waitpid(job.pid, &job.status, WNOHANG) == job.pid) {
      job.ended = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return job.ended;
}

// --- Item 6: the rendezvous listens on loopback only -------------------------------------------

struct Listener {
  std::string address;  // printable
  int port = 0;
  bool loopback = false;
};

// The TCP sockets in LISTEN state among `pids`' open files (from /proc/net/tcp and tcp6).
std::vector<Listener> listeners_of(const std::vector<int>& pids) {
  std::set<std::string> inodes;
  for (int pid : pids) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
      std::error_code lec;
      const std::string target = fs::read_symlink(e.path(), lec).string();
      if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  std::vector<Listener> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream in(read_file(table));
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream row(line);
      std::string sl, local, remote, st, queues, timer, retr, uid, timeout, inode;
      row >> sl >> local >> remote >> st >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (st != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      const auto colon = local.find(':');
      const std::string hex = local.substr(0, colon);
      Listener l;
      l.port = std::stoi(local.substr(colon + 1), nullptr, 16);
      char text[INET6_ADDRSTRLEN] = {};
      if (hex.size() == 8) {
        in_addr a{};
        a.s_addr = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
        inet_ntop(AF_INET, &a, text, sizeof(text));
        l.loopback = (ntohl(a.s_addr) >> 24) == 127;
      } else {
        in6_addr a{};
        for (size_t w = 0; w < 4; ++w) {
          const uint32_t word =
              static_cast<uint32_t>(std::stoul(hex.substr(8 * w, 8), nullptr, 16));
          std::memcpy(&a.s6_addr[4 * w], &word, 4);
        }
        inet_ntop(AF_INET6, &a, text, sizeof(text));
        l.loopback = IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
      }
      l.address = text;
      out.push_back(l);
    }
  }
  return out;
}

// This machine's first IPv4 address that is not loopback, empty when it has none.
std::string non_loopback_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string out;
  for (ifaddrs* i = list; i != nullptr && out.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const auto* a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if ((ntohl(a->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    out = text;
  }
  ::freeifaddrs(list);
  return out;
}

bool can_connect(const std::string& address, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, address.c_str(), &a.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

TEST(LaunchRendezvous, LocalRunListensOnLoopbackOnly) {
  Job job;
  start(job, long_run(2, "61001"), "rendezvous_loopback");
  wait_until_training(job, 2);
  std::vector<int> pids{job.pid};
  for (const auto& [r, pid] : job.ranks)
    pids.push_back(pid);
  const auto listeners = listeners_of(pids);
  EXPECT_FALSE(listeners.empty()) << "no listening socket found in the job's processes";
  for (const auto& l : listeners) {
    EXPECT_TRUE(l.loopback) << "the job listens on " << l.address << ":" << l.port;
  }
  // From an address of this machine that is not loopback, nothing of the job answers.
  const std::string other = non_loopback_ipv4();
  if (!other.empty()) {
    for (const auto& l : listeners) {
      EXPECT_FALSE(can_connect(other, l.port)) << "port " << l.port << " answers on " << other;
    }
  }
  ::kill(job.pid, SIGTERM);
  EXPECT_TRUE(wait_exit(job, 20)) << job.output();
}

// --- Item 7: ranks die with their launcher; no temporary files are left ------------------------

// True once every rank process is gone, false after `seconds`.
bool ranks_gone(const Job& job, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < deadline) {
    bool all = true;
    for (const auto& [r, pid] : job.ranks)
      all = all && gone(pid);
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Starts a job with a private TMPDIR, lets it train, sends `sig` to the launcher and checks that
// both ranks are gone within a few seconds and TMPDIR is empty.
void expect_ranks_die_with_launcher(int sig, const std::string& name) {
  const std::string tmp = hp::testing::scratch_dir() + "/" + name + "_tmp";
  fs::create_directories(tmp);
  Job job;
  start(job, long_run(2, name == "kill9" ? "61002" : "61003"), name, {{"TMPDIR", tmp}});
  wait_until_training(job, 2);
  ASSERT_EQ(::kill(job.pid, sig), 0);
  ASSERT_TRUE(wait_exit(job, 20)) << job.output();
  EXPECT_TRUE(ranks_gone(job, 5)) << "rank processes outlived their launcher (signal " << sig
                                  << ")\n"
                                  << job.output();
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(tmp))
    left.push_back(e.path().filename());
  EXPECT_TRUE(left.empty()) << "left in TMPDIR: " << (left.empty() ? "" : left.front());
}

TEST(LaunchTeardown, KillingTheLauncherKillsTheRanks) {
  expect_ranks_die_with_launcher(SIGKILL, "kill9");
}

TEST(LaunchTeardown, HangingUpTheLauncherStopsTheRanks) {
  expect_ranks_die_with_launcher(SIGHUP, "hangup");
}

TEST(LaunchTeardown, HangUpIsReportedLikeAnInterrupt) {
  Job job;
  start(job, long_run(2, "61004"), "hangup_report");
  wait_until_training(job, 2);
  ASSERT_EQ(::kill(job.pid, SIGHUP), 0);
  ASSERT_TRUE(wait_exit(job, 20)) << job.output();
  EXPECT_TRUE(WIFEXITED(job.status) && WEXITSTATUS(job.status) == 128 + SIGHUP)
      << "status " << job.status << "\n"
      << job.output();
  EXPECT_NE(job.output().find("hp-train: interrupted by signal 1; stopped all ranks"),
            std::string::npos)
      << job.output();
}

// --- Item 8: one default group timeout; --timeout checked before anything starts ---------------

TEST(GroupTimeout, EveryToolDocumentsTheSameDefault) {
  for (const std::string& cmd :
       {std::string(HP_TRAIN_BINARY) + " --help", std::string(HP_BENCH_BINARY) + " comm --help",
        std::string(HP_BENCH_BINARY) + " cp --help",
        std::string(HP_BENCH_BINARY) + " hsdp --help"}) {
    auto r = hp::testing::run_command(cmd);
    const auto at = r.out.find("--timeout");
    ASSERT_NE(at, std::string::npos) << cmd << "\n" << r.out;
    const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_NE(line.find("300"), std::string::npos) << cmd << ": " << line;
  }
}

TEST(GroupTimeout, BadValuesAreRefusedBeforeAnyRankStarts) {
  const std::vector<std::string> tools{
      std::string(HP_TRAIN_BINARY) + " --nproc 2 --cp 2",
      std::string(HP_BENCH_BINARY) + " comm --nproc 2",
      std::string(HP_BENCH_BINARY) + " cp --nproc 2 --seq 64",
      std::string(HP_BENCH_BINARY) + " hsdp --nproc 2 --dp-shard 2"};
  for (const auto& tool : tools) {
    for (const std::string bad : {"0", "-5", "nan", "inf"}) {
      auto r = hp::testing::run_command(std::string(tool).append(" --timeout ").append(bad));
      EXPECT_NE(r.rc, 0) << tool << " --timeout " << bad << "\n" << r.out;
      EXPECT_NE(r.out.find("--timeout " + bad + " is not valid"), std::string::npos)
          << tool << " --timeout " << bad << "\n"
          << r.out;
      EXPECT_EQ(r.out.find("rank "), std::string::npos) << "ranks were started\n" << r.out;
    }
  }
}

// --- Item 9: the summary names the rank that failed or hung first ------------------------------

// The launcher's summary: the last line of the output naming a pid ("rank R (pid P) ...").
std::string summary_line(const std::string& out) {
  const auto at = out.rfind("(pid ");
  if (at == std::string::npos) return "";
  const auto begin = out.rfind('\n', at);
  const auto end = out.find('\n', at);
  return out.substr(begin == std::string::npos ? 0 : begin + 1,
                    end == std::string::npos ? std::string::npos : end - begin - 1);
}

TEST(FailureBlame, StoppedRankIsNamedAsHung) {
  Job job;
  auto args = long_run(3, "61005");
  args.insert(args.end() - 2, {"--timeout", "5"});
  start(job, args, "blame_stopped");
  wait_until_training(job, 3);
  const int victim = job.ranks.at(1);
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);
  ASSERT_TRUE(wait_exit(job, 40)) << job.output();
  EXPECT_TRUE(ranks_gone(job, 5));
  const std::string line = summary_line(job.output());
  EXPECT_EQ(line.rfind("hp-train: rank 1 (pid " + std::to_string(victim) + ")", 0), 0)
      << "summary: " << line << "\n"
      << job.output();
  EXPECT_NE(line.find("stopped making progress"), std::string::npos) << line;
  EXPECT_NE(job.status, 0);
}

TEST(FailureBlame, KilledRankIsNamedFirstWithItsSignal) {
  Job job;
  start(job, long_run(3, "61006"), "blame_killed");
  wait_until_training(job, 3);
  const int victim = job.ranks.at(2);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_TRUE(wait_exit(job, 40)) << job.output();
  const std::string line = summary_line(job.output());
  EXPECT_EQ(line.rfind("hp-train: rank 2 (pid " + std::to_string(victim) +
                           ") was killed by signal 9 (Killed)",
                       0),
            0)
      << "summary: " << line << "\n"
      << job.output();
  EXPECT_TRUE(WIFEXITED(job.status) && WEXITSTATUS(job.status) == 128 + SIGKILL) << job.status;
}

// --- --max-restarts: a killed rank costs a restart from the last checkpoint, not the run -------

std::vector<std::string> restart_run(const std::string& dir, const std::string& seed) {
  return {HP_TRAIN_BINARY,
          "--nproc",
          "2",
          "--cp",
          "2",
          "--seq-len",
          "48",
          "--layers",
          "1",
          "--hidden",
          "24",
          "--heads",
          "3",
          "--kv-heads",
          "3",
          "--head-dim",
          "8",
          "--ffn",
          "32",
          "--steps",
          "40",
          "--checkpoint-dir",
          dir + "/ckpt",
          "--checkpoint-every",
          "5",
          "--metrics-json",
          dir + "/metrics.json",
          "--seed",
          seed};
}

TEST(MaxRestarts, KilledRankRestartsFromTheLastCheckpointWithTheSameLosses) {
  const std::string plain = hp::testing::scratch_dir() + "/restart_plain";
  const std::string faulty = hp::testing::scratch_dir() + "/restart_faulty";
  fs::create_directories(plain);
  fs::create_directories(faulty);
  {
    Job job;
    start(job, restart_run(plain, "61007"), "restart_plain");
    ASSERT_TRUE(wait_exit(job, 120)) << job.output();
    ASSERT_TRUE(WIFEXITED(job.status) && WEXITSTATUS(job.status) == 0) << job.output();
  }
  Job job;
  auto args = restart_run(faulty, "61007");
  args.insert(args.end() - 2, {"--max-restarts", "2"});
  start(job, args, "restart_faulty");
  // Kill rank 1 once the first checkpoint is complete (its step directory renamed into place).
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (!fs::exists(faulty + "/ckpt/step_00000005/manifest.json") && Clock::now() < deadline) {
    ASSERT_EQ(::waitpid(job.pid, &job.status, WNOHANG), 0) << job.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  int victim = -1;
  for (int pid : children_of(job.pid)) {
    if (rank_of(pid) == 1) victim = pid;
  }
  ASSERT_GT(victim, 0) << job.output();
  job.ranks[1] = victim;
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_TRUE(wait_exit(job, 120)) << job.output();
  EXPECT_TRUE(WIFEXITED(job.status) && WEXITSTATUS(job.status) == 0) << job.output();
  const std::string out = job.output();
  EXPECT_NE(out.find("restart 1 of 2"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1 (pid " + std::to_string(victim) + ") was killed by signal 9"),
            std::string::npos)
      << out;
  // The restarted run's steps are the uninterrupted run's, bit for bit.
  auto a = nlohmann::json::parse(read_file(plain + "/metrics.json"));
  auto b = nlohmann::json::parse(read_file(faulty + "/metrics.json"));
  const auto& sa = a.at("steps");
  const auto& sb = b.at("steps");
  ASSERT_EQ(sa.size(), 40u);
  ASSERT_FALSE(sb.empty());
  EXPECT_GT(sb.front().at("step").get<int64_t>(), 1) << "the restart did not resume";
  EXPECT_EQ(sb.back().at("step").get<int64_t>(), 40);
  for (const auto& s : sb) {
    const int64_t step = s.at("step").get<int64_t>();
    EXPECT_EQ(s.at("loss").get<double>(), sa[step - 1].at("loss").get<double>()) << "step " << step;
  }
  EXPECT_EQ(b.at("final_loss").get<double>(), a.at("final_loss").get<double>());
}

TEST(MaxRestarts, NeedsCheckpoints) {
  for (const std::string& extra :
       {std::string(), " --checkpoint-dir " + hp::testing::scratch_dir() + "/x"}) {
    auto r = hp::testing::run_command(std::string(HP_TRAIN_BINARY) +
                                      " --nproc 2 --cp 2 --max-restarts 1" + extra);
    EXPECT_EQ(r.rc, 1) << r.out;
    EXPECT_NE(r.out.find("--max-restarts 1 needs --checkpoint-dir and --checkpoint-every"),
              std::string::npos)
        << r.out;
    EXPECT_EQ(r.out.find("hp-train: plan"), std::string::npos) << r.out;
  }
}

// Started by an external launcher (torchrun's variables, not hp-train's own local ranks): the
// local launcher's --max-restarts and --nproc would do nothing, so they are refused before the
// rendezvous (MASTER_PORT 1: nothing listens there).
TEST(MaxRestarts, UnderAnExternalLauncherTheLocalLaunchersOptionsAreRefused) {
  const std::string env =
      "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 ";
  const std::string dir = hp::testing::scratch_dir() + "/external";
  auto r = hp::testing::run_command(env + HP_TRAIN_BINARY + " --cp 2 --max-restarts 1 " +
                                    "--checkpoint-dir " + dir + " --checkpoint-every 1");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("--max-restarts 1 restarts the ranks hp-train launches itself (--nproc N), "
                       "but this process was started by an external launcher"),
            std::string::npos)
      << r.out;
  r = hp::testing::run_command(env + HP_TRAIN_BINARY + " --cp 2 --nproc 2");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("--nproc 2 spawns local ranks, but this process was started by an "
                       "external launcher (RANK/WORLD_SIZE set, world size 2)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("hp-train: plan"), std::string::npos) << r.out;
}

}  // namespace
