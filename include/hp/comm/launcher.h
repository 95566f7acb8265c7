// Local multi-process launcher (what `--nproc N` does in hp-train and hp-bench).
//
// Spawns N rank processes of one command with torchrun-style variables (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and per-rank thread counts
// (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, HP_NUM_THREADS) so N ranks do not oversubscribe
// the cores.
//
// The launcher hosts the job's rendezvous store itself (a TCPStore listening on master_addr,
// 127.0.0.1, only; HP_STORE_ON_LAUNCHER=1 tells the ranks to join it as clients), so the store
// outlives any rank and the launcher can read the ranks' heartbeats from it (each World of more
// than one rank writes one, see WorldOptions::heartbeat_interval).
//
// Failures. When a rank fails, the launcher waits `settle` for the consequences (peers that
// lose it fail too), then names the rank that failed *first*, with its own error, and stops the
// others (SIGTERM, then SIGKILL after `grace`). First means, in this order: a rank killed by a
// signal; a rank that stopped making progress (alive, but its process is stopped or its
// heartbeat stopped, or it is the only one behind in collectives launched) while the others
// failed waiting for it; a rank that failed with its own error (not a communication error,
// which a peer's failure causes); the rank that failed earliest.
//
// Restarts (torchrun's elastic agent, locally). With max_restarts = K > 0, a failed run (not an
// interrupted one) is followed by a new run of all ranks, up to K times, each logged with the
// failure that caused it; attempt k runs argv_for_attempt(k) when set (e.g. hp-train adds
// --resume once a checkpoint exists), else argv. Each run gets a fresh store. A run whose
// failed rank reported one of the program's own checks (check_error below) is not restarted.
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
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "hp/comm/types.h"

namespace hp::comm {

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> argv;  // program and arguments, the same for every rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;       // 0: pick a free port
  int threads_per_rank = 0;  // 0: available cores / nproc (at least 1)
  std::vector<std::pair<std::string, std::string>> extra_env;
  std::chrono::milliseconds grace{3000};  // SIGTERM -> SIGKILL delay during teardown
  std::chrono::milliseconds settle{500};  // first failure -> blame and teardown
  std::chrono::milliseconds store_timeout = kDefaultTimeout;  // the hosted store's timeout
  int max_restarts = 0;  // runs of all ranks after a failed one (see above)
  // The command line of attempt k (0: the first run); null: `argv` every time.
  std::function<std::vector<std::string>(int attempt)> argv_for_attempt;
  // Where restart lines go ("rank 1 (pid ..) ...; restarting all ranks (restart 1 of 2)");
  // null: stderr.
  std::function<void(const std::string&)> log;
};

struct LaunchResult {
  int exit_code = 0;         // 0 when every rank succeeded
  int failed_rank = -1;      // the rank that failed first (see above), -1 if none
  std::string message;       // what failed, including the rank's own error when it reported one
  bool interrupted = false;  // stopped by SIGINT, SIGTERM or SIGHUP to the launcher
  int restarts = 0;          // restarts done (the result is the last run's)
  // The failed rank's error was one of the program's own checks (hp::Error, not a CommError):
  // the run is not restarted, since the same command would refuse the same way.
  bool check_error = false;
};

LaunchResult launch_local_ranks(const LaunchOptions& options);

// A TCP port on 127.0.0.1 that was free a moment ago.
int pick_free_port();

// Absolute path of the running executable (/proc/self/exe).
std::string self_executable();

// For a tool's main() given --nproc N outside a launcher: re-runs the same command line as N
// local rank processes and returns the job's exit code (the failure message goes to stderr,
// prefixed with `tool`). The second form takes the launch options (argv[0] becomes this
// executable, in argv_for_attempt's command lines too; restart lines are prefixed with `tool`
// unless options.log is set).
int relaunch_as_local_ranks(int nproc, const std::vector<std::string>& argv,
                            const std::string& tool);
int relaunch_as_local_ranks(LaunchOptions options, const std::string& tool);

// For a rank's main(): records its error where the launcher looks for it (HP_ERROR_FILE), so
// the launcher's failure message can quote the rank's error. No-op outside the launcher. The
// exception form also tells the launcher whether it was a communication error (hp::CommError:
// most likely caused by a peer), one of the program's checks (another hp::Error: not worth a
// restart) or something else, and leaves out LibTorch's backtraces.
void report_rank_error(const std::string& what);
void report_rank_error(const std::exception& error);

}  // namespace hp::comm
