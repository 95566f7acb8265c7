#include "hp/bench/attention_bench.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "hp/attention/attention.h"
#include "hp/common/check.h"

namespace hp::bench {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int64_t current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// One forward + backward of `prim` on fresh leaves of q, k, v (dout drives the backward):
// its wall time in seconds.
double time_fwd_bwd(const attention::AttentionPrimitive& prim, const at::Tensor& q,
                    const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                    const attention::AttentionOptions& ao) {
  auto qq = q.detach().requires_grad_(true);
  auto kk = k.detach().requires_grad_(true);
  auto vv = v.detach().requires_grad_(true);
  auto t0 = std::chrono::steady_clock::now();
  auto r = prim.forward(qq, kk, vv, ao);
  torch::autograd::backward({r.out}, {dout});
  return seconds_since(t0);
}

}  // namespace

int64_t process_peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

double measure_matmul_gflops() {
  auto a = at::randn({2048, 2048});
  auto b = at::randn({2048, 2048});
  at::matmul(a, b);  // warm-up
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    auto c = at::matmul(a, b);
    t.push_back(seconds_since(t0));
  }
  return 2.0 * 2048.0 * 2048.0 * 2048.0 / median(t) / 1e9;
}

std::function<double()> make_reference_step() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4321);
  auto make = [&] { return at::randn({1, 8, kReferenceStepSeq, 64}, gen, at::kFloat); };
  auto q = make(), k = make(), v = make(), dout = make();
  return [q, k, v, dout] {
    attention::AttentionOptions ao;
    ao.causal = true;
    return time_fwd_bwd(attention::AttentionRegistry::builtin().get("blockwise"), q, k, v, dout,
                        ao);
  };
}

double attention_fwd_flops(const AttentionBenchOptions& o) {
  const double s = static_cast<double>(o.seq);
  const double dense = 4.0 * o.batch * o.heads * s * s * o.head_dim;
  return o.causal ? dense / 2 : dense;
}

int64_t math_score_bytes(const AttentionBenchOptions& o) {
  // scores + probabilities (+ autograd's saved copies): about three [B, H, S, S] fp32 tensors.
  return 3 * o.batch * o.heads * o.seq * o.seq * 4;
}

AttentionBenchResult run_attention_bench(const AttentionBenchOptions& o, const std::string& name) {
  HP_CHECK(o.seq >= 1 && o.heads >= 1 && o.kv_heads >= 1 && o.head_dim >= 1 && o.batch >= 1,
           "hp-bench attention: sizes must be >= 1");
  HP_CHECK(o.iters >= 1, "hp-bench attention: --iters=", o.iters, " must be >= 1");
  const auto& prim = attention::AttentionRegistry::builtin().get(name);
  const int64_t rss_before = current_rss_bytes();
  auto q = at::randn({o.batch, o.heads, o.seq, o.head_dim});
  auto k = at::randn({o.batch, o.kv_heads, o.seq, o.head_dim});
  auto v = at::randn({o.batch, o.kv_heads, o.seq, o.head_dim});
  auto dout = at::randn({o.batch, o.heads, o.seq, o.head_dim});
  attention::AttentionOptions ao;
  ao.causal = o.causal;
  if (o.block_q > 0) ao.block_q = o.block_q;
  if (o.block_kv > 0) ao.block_kv = o.block_kv;

  std::vector<double> fwd, fwd_bwd;
  for (int i = 0; i <= o.iters; ++i) {
    at::NoGradGuard no_grad;
    auto t0 = std::chrono::steady_clock::now();
    auto r = prim.forward(q, k, v, ao);
    if (i > 0) fwd.push_back(seconds_since(t0));
  }
  for (int i = 0; i <= o.iters; ++i) {
    const double dt = time_fwd_bwd(prim, q, k, v, dout, ao);
    if (i > 0) fwd_bwd.push_back(dt);
  }
  AttentionBenchResult res;
  res.primitive = name;
  res.fwd_s = median(fwd);
  res.fwd_bwd_s = median(fwd_bwd);
  res.fwd_bwd_samples_s = fwd_bwd;
  const double flops = attention_fwd_flops(o);
  res.fwd_gflops = flops / res.fwd_s / 1e9;
  res.fwd_bwd_gflops = 3.5 * flops / res.fwd_bwd_s / 1e9;
  res.peak_rss_bytes = process_peak_rss_bytes();
  res.peak_bytes = res.peak_rss_bytes - rss_before;
  return res;
}

}  // namespace hp::bench
