// A measured cost model for one CP attention layer step (forward + backward), and the choice
// behind `--cp-algo auto`.
//
//   Calibration (hp-bench calibrate; cached per machine and link, inputs recorded):
//     per collective kind and world size: t = latency + bytes_sent_per_rank * seconds_per_byte
//     (all ranks share the link, so each world size has its own fit); one-thread blockwise
//     attention and matmul throughput.
//   Prediction for (algorithm, ulysses_degree, schedule) on P ranks:
//     compute = max(slowest rank's attention flops on one core,
//                   all ranks' attention flops on min(cores, P) cores)     (attention GF/s)
//             + the rank's projection flops / (matmul GF/s x its core share min(1, cores/P))
//     comm    = sum over the step's collectives (volume formulas of cp/volume.h) of t(kind, P)
//     exposed = comm (sync); async: the collectives it launches early hide behind the
//               projection work that follows them (up to `overlap_budget` of it) and behind
//               attention on local data (all_gather: 1/P of it; ulysses: 1/P^2)
//             (the ring's async schedule is its sync one; its shifts hide behind its blocks'
//             attention, and what they do not hide is scaled by the measured
//             ring_exposed_scale at its size; its attention runs at ring_attention_factor x the
//             rate)
//     compute += async_seconds_per_token (ulysses, usp: ulysses_async_seconds_per_token) x local
//             tokens / core share, for an async schedule that launches collectives at the
//             handoffs (what it costs beyond sync: so that where there is little to hide, sync
//             wins)
//     step    = compute + exposed + seconds_per_token x local tokens / core share
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hp/cp/config.h"

namespace hp::plan {

struct CollectiveFit {
  double latency_s = 0;
  double seconds_per_byte = 0;
  double time(double bytes) const { return latency_s + bytes * seconds_per_byte; }
};

// The line latency + bytes * seconds_per_byte through two timed sizes (small, then large; bytes
// and seconds). Where noise on a shared machine made the small size no faster than the large
// one, the slope is not a free link: the line goes through the origin and the large point
// instead (all of its time counted as bandwidth), so seconds_per_byte is never 0 for a
// positive timing. `through_origin`, if given, says which line was taken.
CollectiveFit fit_collective_line(double small_bytes, double small_s, double large_bytes,
                                  double large_s, bool* through_origin = nullptr);

struct Calibration {
  std::string link = "loopback";  // or the emulated rate, e.g. "1gbit"
  int cores = 1;                  // cores of the machine the ranks share
  // "all_gather" | "reduce_scatter" | "all_to_all" | "all_reduce" -> world size -> fit
  std::map<std::string, std::map<int64_t, CollectiveFit>> collectives;
  // Blockwise fwd+bwd, causal (3.5x forward flops), as a rank running on one core reaches it
  // beside the other ranks: hp-bench calibrate fits it from CP layers at two lengths (the
  // one-process, one-thread rate it starts from is in inputs_json).
  double attention_gflops = 0;
  double matmul_gflops = 0;     // one thread
  double overlap_budget = 0.5;  // share of the projection work async can hide collectives behind
  // Per-token cost the flop counts miss (norms, copies, re-layouts, autograd), seconds per
  // local token at one core: fitted by hp-bench calibrate with attention_gflops, on a CP layer
  // outside the grid at two lengths.
  double seconds_per_token = 0;
  // What the async schedule costs beyond sync on the rank's core (attention split into calls
  // merged by lse, K/V slices and their gradients, the comm thread's copies), seconds per
  // local token at one core: fitted by hp-bench calibrate from sync and async steps timed in
  // pairs. Per token, not per flop: at S = 4096 and 16384 it was the same per token.
  double async_seconds_per_token = 0;
  // The same for async Ulysses, fitted the same way from its own pairs: it attends each head
  // group in one call, with no local/remote split to merge, and paid about half of
  // all_gather's at S = 4096 in every report (docs/benchmarks.md). A calibration file from
  // before it takes async_seconds_per_token.
  double ulysses_async_seconds_per_token = 0;
  // What each ring step costs beyond its flops at ring_attention_factor (the call per block,
  // the lse merge, the wait for the neighbour's block), seconds per local token per step at one
  // core: fitted by hp-bench calibrate from sync ring steps at P = 4 timed in alternation with
  // sync Ulysses steps (the same attention work per rank), so the machine's drift cancels.
  // Before the transport stopped asking Gloo's point-to-point works for a Future (each refusal
  // built a c10::Error) it came out at 0.6-1.3e-4 s at S = 4096-16384; since, 0-7e-6 s.
  double ring_seconds_per_token_step = 0;
  // The ring's attention (ring and usp) over the attention the rate above predicts for its
  // flops: fitted by hp-bench calibrate from ring steps timed in alternation with Ulysses steps
  // at P = 2, S = 8192 (the same attention work per rank, the measured waits taken out). Its
  // blocks arrive while it computes, and the transfers' CPU and the calls per key chunk cost
  // it 10-15% beside Ulysses at S = 4096, 8192 and 16384 (a share of its attention, not a
  // cost per token: docs/benchmarks.md). It also lengthens the work each shift hides behind.
  double ring_attention_factor = 1;
  // Per ring size C (the ring's members: P for the ring, P / U for usp): the ring's measured
  // waits over those the step model predicts (same calibration runs, rings of all P ranks:
  // C = 2 from the S = 8192 pairs, C = 4 from the S = 4096 pairs). The model charges each shift
  // whole against one block's attention; the ranks' unequal routes (in a causal head-tail ring
  // of two, one member sends one chunk, its partner two) and the chunk-by-chunk waits hide
  // more, most in a ring of two (measured 0.4-0.7 of the model there, 0.9 with four; usp at
  // P = 4, U = 2 runs rings of two). The nearest measured size where one is absent; 1 where
  // none is.
  std::map<int64_t, double> ring_exposed_scale;
  std::string inputs_json = "{}";  // what the calibration ran (commands, sizes, raw results)

  const CollectiveFit& fit(const std::string& kind, int64_t world_size) const;
  double ring_exposed_scale_at(int64_t ring_size) const;
};

std::string to_json(const Calibration& c);
Calibration calibration_from_json(const std::string& json);
void save_calibration(const std::string& path, const Calibration& c);
// Throws a clear error naming the command that creates it when `path` does not exist.
Calibration load_calibration(const std::string& path);
// Set by `hp-bench --link-rate` for the run inside the emulated link: its rate.
inline constexpr const char* kLinkRateEnv = "HP_LINK_RATE";
// The link this process runs on: the emulated rate inside `hp-bench --link-rate`, else
// "loopback".
std::string current_link();
// $HP_CALIBRATION, else ${XDG_CACHE_HOME:-$HOME/.cache}/hyperparallel/calibration-<link>.json
std::string default_calibration_path(const std::string& link);

struct CPWorkload {
  int64_t seq = 0, heads = 0, kv_heads = 0, head_dim = 0, batch = 1;
  bool causal = true;
  bool projections = true;  // Q/K/V/O projections around attention (async hides behind them)
  int64_t hidden = 0;       // model width (0: heads * head_dim)
  bool load_balance = false;
  int ranks_on_node = 0;  // ranks sharing the machine's cores (0: P)
  // The ring's backward recomputes the forward of every block that travelled: the attention
  // primitive offers no backward from the merged statistics (math, sdpa). The blockwise
  // primitive does (AttentionPrimitive::offers_backward_from_stats): no recompute.
  bool ring_recomputes = false;
  // repeat: the Ulysses-family candidates (ulysses, hybrid, usp) may repeat K/V heads fewer
  // than their Ulysses degree (cp_config.kv_head_policy); they then move one K/V head per rank.
  cp::KVHeadPolicy kv_head_policy = cp::KVHeadPolicy::kError;
};

struct CPPrediction {
  cp::ContextParallelConfig config;
  std::string name;  // "ulysses/async", "hybrid(U=2)/sync", "ring(kept)/sync", ...
  double compute_s = 0, comm_s = 0, exposed_comm_s = 0, step_s = 0;
};

// Every legal (algorithm, ulysses_degree, schedule) for P ranks and these heads; the ring also
// with ring_keep_blocks (all_gather's bytes and memory).
std::vector<cp::ContextParallelConfig> legal_cp_configs(int64_t p, const CPWorkload& w);
CPPrediction predict_cp_step(const Calibration& c, const cp::ContextParallelConfig& config,
                             int64_t p, const CPWorkload& w);
// Predictions for every legal choice, fastest first; of equal steps, the one whose collectives
// take less link time first.
std::vector<CPPrediction> rank_cp_configs(const Calibration& c, int64_t p, const CPWorkload& w);
std::string describe(const CPPrediction& p);  // one log line

// State-passing linear-attention CP (cp/linear.h): the two ways the shard summaries travel, per
// step (forward + backward: the backward reverse fold moves the same volumes back).
//   all_gather  one all-gather of every rank's [S | M] (B*HV*K*(V+K) floats): one latency, then
//               the fold of up to P-1 summaries on the rank (K x K x V matmuls)
//   p2p         P-1 ring steps of the state S (B*HV*K*V floats), each one shift (priced as an
//               all_to_all whose rank sends that much) and one fold
struct StateExchangeWorkload {
  int64_t batch = 1, value_heads = 0, key_dim = 0, value_dim = 0;
  int64_t layers = 1;  // linear layers per step
};
struct StateExchangePrediction {
  std::string name;  // "all_gather" | "p2p"
  double comm_s = 0, fold_s = 0, step_s = 0;
};
// Both exchanges, fastest first.
std::vector<StateExchangePrediction> rank_state_exchanges(const Calibration& c, int64_t p,
                                                          const StateExchangeWorkload& w);
std::string describe(const StateExchangePrediction& p);  // one log line

}  // namespace hp::plan
