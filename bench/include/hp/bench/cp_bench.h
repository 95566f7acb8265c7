// `hp-bench cp`: forward + backward of one CP attention layer over the world's ranks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hp/comm/world.h"
#include "hp/cp/config.h"

namespace hp::bench {

struct CPBenchOptions {
  int64_t seq = 8192;
  int64_t heads = 8;
  int64_t kv_heads = 8;
  int64_t head_dim = 64;
  int64_t batch = 1;
  bool causal = false;
  cp::ContextParallelConfig config;  // as given (normalised inside)
  std::string adapter = "sdpa_qkv";
  int iters = 3;
  bool projections = false;  // Q/K/V/O projections around attention (what async overlaps)
  int64_t documents = 0;     // packed: this many equal documents per sequence (0: none)
  // "all_gather" | "ulysses" | "ring" (sync, no documents): that algorithm's layer on the same
  // shape (balanced where it can be when this one is) is timed in alternation with this one.
  // What the cost model's calibration compares strategies with, free of the machine's drift.
  // "contiguous" (a balanced layer, either schedule, no documents): the same layer on
  // contiguous shards, so paired_speedup is what head-tail balance buys.
  std::string paired_with;
  // The paired Ulysses layer's K/V head policy where this layer moves every K/V head whole
  // (all_gather, ring) and so cannot take kv_head_policy=repeat itself: `--cp-algo all_gather
  // --paired-with ulysses --kv-head-policy repeat` gives the permission to the paired layer.
  // Unset: the paired Ulysses layer takes config's policy.
  std::optional<cp::KVHeadPolicy> paired_kv_head_policy;
  // After each round of the layers' timed steps, every rank runs the reference step
  // (attention_bench.h) at once; its slowest rank's time is recorded like a layer step. What the
  // report reads the machine's speed during a run from, against the calibration's.
  bool reference_step = false;
};

// The fraction of the [seq x seq] score tiles (tile x tile) attention computes: causal and/or
// `documents` equal documents (0: none). What block skipping should save with documents.
double visible_tile_fraction(int64_t seq, bool causal, int64_t documents, int64_t tile = 256);

struct CPBenchResult {
  std::string algorithm, schedule;
  bool ring_keep_blocks = false;  // the variant's ContextParallelConfig::ring_keep_blocks
  cp::KVHeadPolicy kv_head_policy = cp::KVHeadPolicy::kError;  // the variant's
  // The variant's head groups, row parts, local-first choice and ring backward (as configured;
  // 0: automatic).
  int64_t ulysses_head_groups = 0, ulysses_row_parts = 0;
  bool always_local_first = false;
  cp::RingBackward ring_backward = cp::RingBackward::kAuto;
  int64_t cp = 1, ulysses_degree = 1, seq = 0;
  double step_time_s = 0;  // median over iterations of the slowest rank
  // Bytes handed to the transport in one step (forward + backward), counted on every rank
  // (by_rank), and cp::step_bytes_per_rank of every rank (theory_by_rank); the scalars are the
  // busiest rank's (ranks differ where a causal ring's chunks stop early, cp/volume.h).
  int64_t comm_bytes_per_rank = 0;
  int64_t comm_bytes_theory = 0;
  std::vector<int64_t> comm_bytes_by_rank, comm_bytes_theory_by_rank;
  // Emulated link: what crossed the shaped loopback per step / P (the mean over ranks).
  int64_t wire_bytes_per_rank = -1;
  // Max over ranks of the process's peak RSS after this layer's warm-up (which includes the
  // layers warmed up before it: for async, the sync schedule's).
  int64_t peak_rss_bytes = 0;
  std::vector<int64_t> peak_rss_per_rank;
  // What one step of this layer adds to the process at its peak, measured on one untimed step
  // after the warm-up (the timed steps pay no trim): before it the allocator returns its free
  // pages (malloc_trim) and the kernel's high-water mark is reset to the resident set
  // (/proc/self/clear_refs); after it, high-water mark minus that resident set. Max over ranks
  // (per rank in step_peak_per_rank). Excludes what every layer shares (the library, the
  // inputs, the layer's weights); -1 where the kernel refuses the reset.
  int64_t step_peak_bytes = -1;
  std::vector<int64_t> step_peak_per_rank;
  // The same for the live CPU tensor bytes, counted at the allocator (tensor_bytes.h): what a
  // step's tensors add at their peak, counted exactly (the resident-set
  // figure above adds the C allocator's caching and fragmentation). -1 if not counted.
  int64_t step_tensor_peak_bytes = -1;
  // Fresh pages a timed step took from the system for large tensors: the caching host
  // allocator's system_bytes over the step (common/host_allocator.h), median over steps, max
  // over ranks. 0 in a steady state; -1 without the cache (--host-allocator system).
  int64_t fresh_host_bytes_per_step = -1;
  std::vector<int64_t> step_tensor_peak_per_rank;
  // CPU time of the rank's main thread during a step (median): the attention compute.
  std::vector<double> attention_cpu_s_per_rank;
  // Time blocked in collective waits per step (median, mean over ranks), and for the async
  // schedule the fraction of the sync schedule's communication time (measured in the same
  // run: there every collective is waited at once, so its waits are its communication time)
  // that the async schedule hid: 1 - exposed_async / exposed_sync.
  double exposed_comm_s = 0;
  double overlap_fraction = 0;
  // With documents: the same batch without documents, timed in the same run, each of its steps
  // right after one with documents (the machine's drift hits both alike): its median step time
  // and the median over iterations of (step without / step with documents).
  double step_time_without_documents_s = 0;
  double documents_speedup = 0;
  // Async: the median over iterations of (sync step / async step), each async step timed right
  // after a sync step of the same batch; above 1 where async is faster.
  double async_speedup = 0;
  // --paired-with: the median over iterations of (the paired layer's step / this step), each
  // step of this layer timed right after one of the paired layer.
  double paired_speedup = 0;
  bool load_balance = false;  // this layer's (the paired layer's can differ)
  // --reference-step: the median over rounds of the slowest rank's reference step (the same in
  // every result of the run); 0 without it.
  double reference_step_s = 0;
};

// Collective over the world; every rank returns the same results. With schedule = async the
// sync schedule runs too (same layer, same data) and comes first in the result. With
// documents, every timed step is followed by one of the same layer without documents. All
// layers are alive during the run and their steps alternate: sync, [sync without documents,]
// async, [async without documents,] sync, ... With paired_with, that layer's result comes
// first and its steps alternate with this one's (paired with contiguous under async: the
// contiguous async layer, then the balanced sync and async ones; the last carries the ratio).
std::vector<CPBenchResult> run_cp_bench(const comm::World& world, const CPBenchOptions& options);

// The layer `options.paired_with` names for `config` at P ranks, checked against the shape;
// throws (naming the flag and the fix) where the pairing is not supported. Empty when none.
std::optional<cp::ContextParallelConfig> paired_config(const CPBenchOptions& options,
                                                       const cp::ContextParallelConfig& config,
                                                       int64_t p);

}  // namespace hp::bench
