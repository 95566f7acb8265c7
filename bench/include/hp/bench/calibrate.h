// `hp-bench calibrate`: measures what the CP cost model (plan/cost_model.h) needs on this
// machine and link, and caches it (default_calibration_path(link)). Runs in this process's
// network namespace, so under --link-rate the collectives see the emulated link.
//   collectives: `hp-bench comm --nproc P --bytes B` for P in {2, 4} and two sizes; a line
//                latency + bytes * seconds_per_byte through the two points, per kind and P
//                (plan::fit_collective_line; inputs.comm_fit says which line each took)
//                (through the origin and the large point where noise made the slope <= 0;
//                inputs.comm_fit says which, so seconds_per_byte is never 0)
//   compute:     one-thread blockwise attention (causal, S = 4096, H = 8, D = 64) and matmul
//   overheads:   per local token (a sync CP layer, measured minus predicted), the ring's per
//                token per step (ring steps paired with Ulysses steps, P = 4) and the async
//                schedule's own cost (sync and async all_gather steps timed in pairs)
//   reference:   the reference step (hp-bench cp --reference-step) of its CP runs at P = 2 and
//                P = 4, so that a later run can tell how fast the machine is then against how
//                fast it was during the calibration
#pragma once

#include <string>

#include "hp/plan/cost_model.h"

namespace hp::bench {

struct CalibrateOptions {
  std::string self_exe;     // the hp-bench binary (its `comm` subcommand runs the collectives)
  std::string child_flags;  // appended to every child command (the tool's --host-allocator)
  std::string link = "loopback";
  int64_t small_bytes = 1 << 20, large_bytes = 8 << 20;
  int comm_iters = 3;
};

plan::Calibration run_calibration(const CalibrateOptions& options);

// The reference step (attention_bench.h) recorded in `calibration` for P ranks on the machine
// (inputs.reference_step.P, from the calibration's CP runs at P = 2 and P = 4), in seconds, or
// a negative value where the calibration has none (made before the reference step existed).
double calibrated_reference_step_s(const plan::Calibration& calibration, int64_t p);

// Runs `cmd` in a shell; its stdout parsed from the first '{' as one JSON object.
std::string run_for_json(const std::string& cmd);

// `cmd` as a reader runs it: where the directory of `exe` (the binaries) lies under `cwd`, each
// mention of it relative to `cwd` (/src/hp/build/tools/hp-bench cp ... -> build/tools/hp-bench
// cp ...); otherwise `cmd` unchanged. Both paths absolute, or `cmd` is returned as it is.
std::string shown_command(const std::string& cmd, const std::string& exe, const std::string& cwd);

// shown_command(cmd, exe, the working directory), or `cmd` where that cannot be read: what the
// calibration and the report record and print of each command they run.
std::string shown_command(const std::string& cmd, const std::string& exe);

}  // namespace hp::bench
