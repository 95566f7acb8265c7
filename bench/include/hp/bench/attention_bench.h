// `hp-bench attention`: one process, one primitive at a time, against this machine's fp32
// matmul roofline measured in the same run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace hp::bench {

struct AttentionBenchOptions {
  int64_t seq = 4096;
  int64_t heads = 8;
  int64_t kv_heads = 8;
  int64_t head_dim = 64;
  int64_t batch = 1;
  bool causal = false;
  int iters = 3;
  int64_t block_q = 0;   // 0: the primitive's default tiling
  int64_t block_kv = 0;  // timed iterations (median); one untimed warm-up before them
};

struct AttentionBenchResult {
  std::string primitive;
  double fwd_s = 0;
  double fwd_bwd_s = 0;                   // median of fwd_bwd_samples_s
  std::vector<double> fwd_bwd_samples_s;  // each timed forward + backward, in order
  double fwd_gflops = 0;       // visible work only: causal fwd = 2*B*H*S^2*D, dense twice that
  double fwd_bwd_gflops = 0;   // 3.5x the forward work
  int64_t peak_bytes = 0;      // peak RSS growth over the RSS before inputs were made
  int64_t peak_rss_bytes = 0;  // peak RSS of the whole process
};

// GFLOP/s of a 2048^3 fp32 matmul (median of 5).
double measure_matmul_gflops();

// The reference step (`hp-bench cp --reference-step`): blockwise attention forward + backward,
// causal, B = 1, H = H_kv = 8, S = kReferenceStepSeq, D = 64, on inputs made once; each call of
// the returned function runs one step at the calling thread's intra-op thread count and returns
// its wall time in seconds. A fixed amount of work, so its time says how fast the machine is
// at that moment under the same ranks-per-core as the steps it is timed beside. Known limit:
// right after much larger steps (S = 16384 layers) it reads about 1.5x slower while those steps
// are 1.0-1.3x slower (docs/benchmarks.md, "The machine's speed during each run").
inline constexpr int64_t kReferenceStepSeq = 2048;
std::function<double()> make_reference_step();

// The process's peak resident set (getrusage), bytes.
int64_t process_peak_rss_bytes();

// Forward FLOPs counted for the figures above.
double attention_fwd_flops(const AttentionBenchOptions& o);

// Runs one primitive (math | blockwise | sdpa) in this process.
AttentionBenchResult run_attention_bench(const AttentionBenchOptions& o,
                                         const std::string& primitive);

// Bytes the math primitive would allocate for its [B, N, S, S] scores and probabilities.
int64_t math_score_bytes(const AttentionBenchOptions& o);

}  // namespace hp::bench
