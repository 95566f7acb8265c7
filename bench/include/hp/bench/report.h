// `hp-bench report`: the benchmark report (docs/benchmarks/). Runs, as child processes of the
// hp-bench binary (each emulated link in its own network namespace; the commands it records name
// the binaries relative to the working directory where they lie under it, as a reader runs them):
//   the calibration of every link (cached; --recalibrate redoes it),
//   the CP grid: algorithms (all_gather and ring with head-tail balance, ulysses; hybrid U=2
//     and usp U=2 with head-tail balance when P >= 4) x schedules (sync, async) x P x S, causal,
//     with the Q/K/V/O projections, one core per rank at P = 2 (two ranks per core at P = 4), plus
//     contiguous all_gather at the largest S, P = 2,
//   the loopback contrast of the async cases at the largest S, P = 2 (when a link is emulated),
//   the attention bench (blockwise) at each S and the HSDP bench,
//   each grid run with --reference-step, so each grid measurement carries the machine's speed
//     during it against the calibrated speed (speed_factor: the run's reference step over the
//     calibration's at the same P) and the prediction at that speed (its compute scaled by
//     the factor; its exposed communication, which the link sets, not),
// then writes results.json (every measurement with the cost model's prediction, raw and at the
// measured speed, "cost_model": {"max_rel_error": .., "max_rel_error_at_speed": ..},
// "auto_selection": [...]), results.md, chart.svg (step
// time per algorithm and schedule, exposed communication shaded) and timeline.svg (one
// hp-train run's per-rank collectives and waits, from its Chrome trace).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp::bench {

struct ReportOptions {
  std::string self_exe;            // hp-bench
  std::string train_exe;           // hp-train (timeline); empty: no timeline
  std::string child_flags;         // appended to every child command (the tool's --host-allocator)
  std::vector<std::string> links;  // "1gbit", "loopback", ...; the first is the main one
  std::string out_dir = "docs/benchmarks";
  std::vector<int64_t> seqs{4096, 16384};
  std::vector<int64_t> ranks{2, 4};
  int64_t heads = 8, kv_heads = 8, head_dim = 64;
  // Timed steps at S < 16384 / at S >= 16384: three at the largest S, so that each figure is a
  // median that one step slowed by the shared machine does not move (two were their mean).
  int iters_small = 3, iters_large = 3;
  bool recalibrate = false;
  bool with_attention = true, with_hsdp = true;
};

// Returns the path of results.json.
std::string run_report(const ReportOptions& options);

}  // namespace hp::bench
