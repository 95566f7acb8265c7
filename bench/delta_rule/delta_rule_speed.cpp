// delta_rule_speed: times the chunked gated delta rule (KDA, GDN) forward and forward+backward,
// the token-by-token recurrence, and a plain batched matmul of the chunked kernel's shapes in
// the same run (issue 14). Standalone: not part of hp-bench; fold in or delete later.
//
//   delta_rule_speed [--tokens 4096] [--heads 8] [--dim 128] [--chunk 64] [--threads 2]
//                    [--reps 5] [--recurrent-tokens 0] [--only kda|gdn] [--profile]
//
// Prints one line per measurement: median (and min) seconds over --reps runs after one warm-up,
// and for
// the chunked kernel the analytic matmul GFLOP/s and its share of the batched-matmul rate.
// Analytic matmul count per chunk of C tokens and head (K = V = dim):
//   forward  2C^2 K (K K^T) + 2C^2 K (Q K^T) + 2C^2 (V + K) (WY: U, W) + 3 * 2CKV (W h, K^T u,
//            Q h) + 2C^2 V (intra-chunk output);  forward+backward = 3 x forward.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/profiler.h>

#include "hp/attention/delta_rule.h"

namespace {

using hp::attention::GateKind;
using Clock = std::chrono::steady_clock;

struct Args {
  int64_t tokens = 4096, heads = 8, dim = 128, chunk = 64, threads = 2, reps = 5;
  int64_t recurrent_tokens = 0;
  std::string only;
  bool profile = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timing {
  double median = 0, min = 0;
};

template <class F>
Timing time_runs(int64_t reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int64_t i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return {median(t), *std::min_element(t.begin(), t.end())};
}

hp::attention::MixerInputs make_inputs(const Args& a, int64_t tokens, GateKind gate) {
  at::manual_seed(0);
  const int64_t b = 1, h = a.heads, d = a.dim;
  auto normed = [](const at::Tensor& t) { return t / t.norm(2, -1, true); };
  hp::attention::MixerInputs in;
  in.q = normed(at::randn({b, tokens, h, d})).requires_grad_(true);
  in.k = normed(at::randn({b, tokens, h, d})).requires_grad_(true);
  in.v = at::randn({b, tokens, h, d}).requires_grad_(true);
  std::vector<int64_t> gs{b, tokens, h};
  if (gate == GateKind::kPerChannel) gs.push_back(d);
  in.g = (at::rand(gs) * -0.5).requires_grad_(true);  // log-gates in [-0.5, 0]
  in.beta = at::sigmoid(at::randn({b, tokens, h})).requires_grad_(true);
  in.initial_state = (at::randn({b, h, d, d}) * 0.1).requires_grad_(true);
  return in;
}

void fwd_bwd(const hp::attention::MixerInputs& in, const hp::attention::MixerOptions& o,
             GateKind gate, bool recurrent) {
  auto r = recurrent ? hp::attention::delta_rule_recurrent(in, o, gate)
                     : hp::attention::delta_rule_chunked(in, o, gate);
  auto loss = r.out.square().sum() + r.final_state.square().sum();
  torch::autograd::grad({loss}, {in.q, in.k, in.v, in.g, in.beta, in.initial_state});
}

double fwd_flops(const Args& a, int64_t tokens) {
  const double c = a.chunk, k = a.dim, v = a.dim;
  const double chunks = static_cast<double>((tokens + a.chunk - 1) / a.chunk);
  const double per = 2 * c * c * k * 2 + 2 * c * c * (v + k) + 3 * 2 * c * k * v + 2 * c * c * v;
  return per * chunks * a.heads;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", f.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (f == "--tokens")
      a.tokens = std::atoll(next());
    else if (f == "--heads")
      a.heads = std::atoll(next());
    else if (f == "--dim")
      a.dim = std::atoll(next());
    else if (f == "--chunk")
      a.chunk = std::atoll(next());
    else if (f == "--threads")
      a.threads = std::atoll(next());
    else if (f == "--reps")
      a.reps = std::atoll(next());
    else if (f == "--recurrent-tokens")
      a.recurrent_tokens = std::atoll(next());
    else if (f == "--only")
      a.only = next();
    else if (f == "--profile")
      a.profile = true;
    else {
      std::fprintf(stderr, "unknown flag %s (see the comment atop delta_rule_speed.cpp)\n",
                   f.c_str());
      return 2;
    }
  }
  at::set_num_threads(static_cast<int>(a.threads));
  std::printf("delta_rule_speed B=1 H=%lld K=V=%lld S=%lld C=%lld threads=%d reps=%lld\n",
              (long long)a.heads, (long long)a.dim, (long long)a.tokens, (long long)a.chunk,
              at::get_num_threads(), (long long)a.reps);

  // Reference: a batched matmul of the chunked kernel's [C, K] x [K, V] shapes, one per chunk and
  // head of the sequence.
  const int64_t n = (a.tokens + a.chunk - 1) / a.chunk * a.heads;
  auto x = at::randn({n, a.chunk, a.dim}), y = at::randn({n, a.dim, a.dim});
  const auto mm = time_runs(a.reps, [&] { at::bmm(x, y); });
  const double mm_s = mm.median, mm_min = mm.min;
  const double mm_rate = 2.0 * n * a.chunk * a.dim * a.dim / mm_s / 1e9;
  std::printf("matmul  bmm [%lld,%lld,%lld]x[%lld,%lld]  %.4f s (min %.4f)  %.1f GFLOP/s\n",
              (long long)n, (long long)a.chunk, (long long)a.dim, (long long)a.dim,
              (long long)a.dim, mm_s, mm_min, mm_rate);

  hp::attention::MixerOptions o;
  o.chunk_size = a.chunk;
  o.output_final_state = true;
  for (auto gate : {GateKind::kPerChannel, GateKind::kPerHead}) {
    const char* name = gate == GateKind::kPerChannel ? "kda" : "gdn";
    if (!a.only.empty() && a.only != name) continue;
    auto in = make_inputs(a, a.tokens, gate);
    const double f = fwd_flops(a, a.tokens);
    const auto tf = time_runs(a.reps, [&] {
      at::NoGradGuard ng;
      hp::attention::delta_rule_chunked(in, o, gate);
    });
    const auto tfb = time_runs(a.reps, [&] { fwd_bwd(in, o, gate, false); });
    const double fwd = tf.median, fwd_min = tf.min, fb = tfb.median, fb_min = tfb.min;
    std::printf("%s chunked fwd      %.4f s (min %.4f)  %.1f GFLOP/s  %.0f%% of matmul\n", name,
                fwd, fwd_min, f / fwd / 1e9, 100 * f / fwd / 1e9 / mm_rate);
    std::printf("%s chunked fwd+bwd  %.4f s (min %.4f)  %.1f GFLOP/s  %.0f%% of matmul\n", name, fb,
                fb_min, 3 * f / fb / 1e9, 100 * 3 * f / fb / 1e9 / mm_rate);
    if (a.profile) {
      torch::autograd::profiler::RecordProfile guard(std::string("/tmp/delta_rule_") + name +
                                                     ".trace.json");
      fwd_bwd(in, o, gate, false);
    }
    if (a.recurrent_tokens > 0) {
      auto rin = make_inputs(a, a.recurrent_tokens, gate);
      auto t0 = Clock::now();
      {
        at::NoGradGuard ng;
        hp::attention::delta_rule_recurrent(rin, o, gate);
      }
      const double rf = std::chrono::duration<double>(Clock::now() - t0).count();
      t0 = Clock::now();
      fwd_bwd(rin, o, gate, true);
      const double rfb = std::chrono::duration<double>(Clock::now() - t0).count();
      std::printf("%s recurrent S=%lld  fwd %.4f s  fwd+bwd %.4f s  (one run each)\n", name,
                  (long long)a.recurrent_tokens, rf, rfb);
    }
  }
  return 0;
}
