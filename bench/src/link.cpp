#include "hp/bench/link.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "hp/common/check.h"
#include "hp/plan/cost_model.h"

namespace hp::bench {
namespace {

bool on_path(const std::string& tool) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(std::string(path ? path : "") + ":/usr/sbin:/sbin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (!dir.empty() && ::access((dir + "/" + tool).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// Runs argv, returns its exit code (-1 when it could not start); no shell involved.
int run(const std::vector<std::string>& argv, bool quiet = false) {
  pid_t pid = ::fork();
  HP_CHECK(pid >= 0, "--link-rate: fork failed");
  if (pid == 0) {
    if (quiet) {
      FILE* devnull = std::fopen("/dev/null", "w");
      if (devnull) ::dup2(fileno(devnull), STDERR_FILENO);
    }
    std::vector<char*> args;
    for (const auto& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

pid_t g_child = -1;  // the run inside the namespace: signals are forwarded to it
void forward_signal(int sig) {
  if (g_child > 0) ::kill(g_child, sig);
}

}  // namespace

int64_t parse_link_rate(const std::string& rate) {
  static const std::pair<const char*, double> units[] = {
      {"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}, {"bit", 1.0}};
  for (const auto& [suffix, scale] : units) {
    const std::string s(suffix);
    if (rate.size() > s.size() && rate.compare(rate.size() - s.size(), s.size(), s) == 0) {
      const std::string number = rate.substr(0, rate.size() - s.size());
      char* end = nullptr;
      const double v = std::strtod(number.c_str(), &end);
      if (end != nullptr && *end == '\0' && v > 0 && std::isfinite(v)) {
        const auto bps = static_cast<int64_t>(v * scale);
        HP_CHECK(bps >= 1000, "--link-rate '", rate, "' is below 1kbit; use a faster rate");
        return bps;
      }
    }
  }
  HP_CHECK(false, "--link-rate '", rate,
           "' is not a rate; use a number with gbit, mbit, kbit or bit (e.g. 1gbit, 100mbit)");
  return 0;
}

std::optional<std::string> emulated_link_rate() {
  auto link = plan::current_link();
  if (link == "loopback") return std::nullopt;
  return link;
}

std::vector<std::string> strip_link_rate(const std::vector<std::string>& argv) {
  std::vector<std::string> out;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--link-rate") {
      ++i;
      continue;
    }
    if (argv[i].rfind("--link-rate=", 0) == 0) continue;
    out.push_back(argv[i]);
  }
  return out;
}

int run_in_emulated_link(const std::string& rate, const std::vector<std::string>& argv) {
  const int64_t bps = parse_link_rate(rate);
  HP_CHECK(::geteuid() == 0,
           "--link-rate needs root to create a network namespace (ip netns) "
           "and shape its loopback (tc); run as root, or drop --link-rate to use plain loopback");
  for (const char* tool : {"ip", "tc"}) {
    HP_CHECK(on_path(tool), "--link-rate needs '", tool,
             "' from iproute2, which is not installed; apt-get install iproute2 (scripts/setup.sh "
             "does), or drop --link-rate");
  }
  const std::string ns = "hp-link-" + std::to_string(::getpid());
  HP_CHECK(run({"ip", "netns", "add", ns}) == 0, "--link-rate: 'ip netns add ", ns,
           "' failed; network namespaces may be disabled here (drop --link-rate)");
  struct Cleanup {
    std::string ns;
    ~Cleanup() { run({"ip", "netns", "del", ns}, true); }
  } cleanup{ns};
  // The bucket must hold at least one loopback packet (up to 64 KiB with GSO) and ~2 ms of
  // traffic; a 100 ms queue keeps senders throttled rather than dropped.
  const int64_t burst = std::max<int64_t>(256 * 1024, bps / 8 / 500);
  HP_CHECK(run({"ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"}) == 0,
           "--link-rate: could not bring up the loopback in namespace ", ns);
  HP_CHECK(
      run({"ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
           std::to_string(bps) + "bit", "burst", std::to_string(burst), "latency", "100ms"}) == 0,
      "--link-rate: 'tc qdisc add dev lo root tbf' failed in namespace ", ns,
      "; the kernel may lack sch_tbf (drop --link-rate)");
  std::vector<std::string> cmd{"ip", "netns", "exec",
                               ns,   "env",   std::string(plan::kLinkRateEnv) + "=" + rate};
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  auto args = strip_link_rate(argv);
  if (n > 0) args[0] = std::string(self, static_cast<size_t>(n));
  cmd.insert(cmd.end(), args.begin(), args.end());
  pid_t pid = ::fork();
  HP_CHECK(pid >= 0, "--link-rate: fork failed");
  if (pid == 0) {
    std::vector<char*> a;
    for (auto& s : cmd)
      a.push_back(s.data());
    a.push_back(nullptr);
    ::execvp(a[0], a.data());
    ::_exit(127);
  }
  g_child = pid;
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  g_child = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int64_t loopback_tx_bytes() {
  std::ifstream f("/proc/self/net/dev");
  std::string line;
  while (std::getline(f, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != "lo") continue;
    std::istringstream fields(line.substr(colon + 1));
    int64_t v[9] = {};
    for (auto& x : v)
      fields >> x;
    return v[8];  // receive: bytes packets errs drop fifo frame compressed multicast; tx bytes
  }
  HP_CHECK(false, "cannot read the loopback counters from /proc/self/net/dev");
  return 0;
}

}  // namespace hp::bench
