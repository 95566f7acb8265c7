// Local multi-process launcher (what `--nproc N` does in hp-train and hp-bench).
//
// Spawns N rank processes of one command with torchrun-style variables (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and per-rank thread counts
// (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, HP_NUM_THREADS) so N ranks do not oversubscribe
// the cores. If any rank fails, the others are stopped (SIGTERM, then SIGKILL after a grace
// period) and the result names the failed rank and its error.
//
// Lifetime. No rank outlives the launcher: SIGINT, SIGTERM and SIGHUP to the launcher stop every
// rank (exit code 128 + signal); each rank gets PR_SET_PDEATHSIG (SIGKILL), so it dies with the
// launcher even when the launcher is killed outright; ranks stay in the launcher's process
// group, so a signal to the job's group (Ctrl-C, a hang-up of the terminal) reaches all of them.
// The launcher creates no files: ranks report their errors into anonymous memory files
// (HP_ERROR_FILE=/proc/self/fd/N), so nothing is left behind however it ends.
//
// Process plumbing for the platform layer, next to its counterpart launch_env.h (which reads
// the variables this launcher sets): tools above any layer (hp-train, hp-bench) and the test
// harness use it without depending on train/.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace hp::comm {

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> argv;  // program and arguments, the same for every rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;       // 0: pick a free port
  int threads_per_rank = 0;  // 0: available cores / nproc (at least 1)
  std::vector<std::pair<std::string, std::string>> extra_env;
  std::chrono::milliseconds grace{3000};  // SIGTERM -> SIGKILL delay during teardown
};

struct LaunchResult {
  int exit_code = 0;         // 0 when every rank succeeded
  int failed_rank = -1;      // first rank that failed, -1 if none
  std::string message;       // what failed, including the rank's own error when it reported one
  bool interrupted = false;  // stopped by SIGINT, SIGTERM or SIGHUP to the launcher
};

LaunchResult launch_local_ranks(const LaunchOptions& options);

// A TCP port on 127.0.0.1 that was free a moment ago.
int pick_free_port();

// Absolute path of the running executable (/proc/self/exe).
std::string self_executable();

// For a tool's main() given --nproc N outside a launcher: re-runs the same command line as N
// local rank processes and returns the job's exit code (the failure message goes to stderr,
// prefixed with `tool`). The second form takes the launch options (argv[0] becomes this
// executable).
int relaunch_as_local_ranks(int nproc, const std::vector<std::string>& argv,
                            const std::string& tool);
int relaunch_as_local_ranks(LaunchOptions options, const std::string& tool);

// For a rank's main(): records `what` where the launcher looks for it (HP_ERROR_FILE), so the
// launcher's failure message can quote the rank's error. No-op outside the launcher.
void report_rank_error(const std::string& what);

}  // namespace hp::comm
