// `hp-bench calibrate`: measures what the CP cost model (plan/cost_model.h) needs on this
// machine and link, and caches it (default_calibration_path(link)). Runs in this process's
// network namespace, so under --link-rate the collectives see the emulated link.
//   collectives: `hp-bench comm --nproc P --bytes B` for P in {2, 4} and two sizes; a line
//                latency + bytes * seconds_per_byte through the two points, per kind and P
//   compute:     one-thread blockwise attention (causal, S = 4096, H = 8, D = 64) and matmul
//   overheads:   per local token (a sync CP layer, measured minus predicted), the ring's per
//                token per step (ring steps paired with Ulysses steps, P = 4) and the async
//                schedule's own cost (sync and async all_gather steps timed in pairs)
#pragma once

#include <string>

#include "hp/plan/cost_model.h"

namespace hp::bench {

struct CalibrateOptions {
  std::string self_exe;  // the hp-bench binary (its `comm` subcommand runs the collectives)
  std::string link = "loopback";
  int64_t small_bytes = 1 << 20, large_bytes = 8 << 20;
  int comm_iters = 3;
};

plan::Calibration run_calibration(const CalibrateOptions& options);

// Runs `cmd` in a shell; its stdout parsed from the first '{' as one JSON object.
std::string run_for_json(const std::string& cmd);

}  // namespace hp::bench
