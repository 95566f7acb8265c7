#include "hp/bench/calibrate.h"

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "hp/bench/attention_bench.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "hp/cp/config.h"

namespace hp::bench {
namespace fs = std::filesystem;

std::string shown_command(const std::string& cmd, const std::string& exe, const std::string& cwd) {
  const fs::path dir = fs::path(exe).parent_path();
  if (dir.empty() || !dir.is_absolute() || !fs::path(cwd).is_absolute()) return cmd;
  const fs::path rel = dir.lexically_relative(cwd);
  if (rel.empty() || *rel.begin() == ".." || rel == ".") return cmd;
  const std::string from = dir.string() + "/", to = rel.string() + "/";
  std::string out = cmd;
  for (size_t at = out.find(from); at != std::string::npos; at = out.find(from, at + to.size()))
    out.replace(at, from.size(), to);
  return out;
}

std::string shown_command(const std::string& cmd, const std::string& exe) {
  std::error_code ec;
  const std::string cwd = fs::current_path(ec).string();
  return ec ? cmd : shown_command(cmd, exe, cwd);
}

std::string run_for_json(const std::string& cmd) {
  FILE* pipe = ::popen(cmd.c_str(), "r");
  HP_CHECK(pipe != nullptr, "cannot start: ", cmd);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0)
    out.append(buf, n);
  const int status = ::pclose(pipe);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;  // -1: ended by a signal
  const auto brace = out.find('{');
  HP_CHECK(rc == 0 && brace != std::string::npos, "command failed (exit ", rc, "): ", cmd, "\n",
           out);
  return out.substr(brace);
}

namespace {

// The layer the calibration's CP runs time (H = H_kv = 8, D = 64, causal, projections) at S, P.
plan::CPWorkload calibration_workload(int64_t seq, int64_t p) {
  plan::CPWorkload w;
  w.seq = seq;
  w.heads = 8;
  w.kv_heads = 8;
  w.head_dim = 64;
  w.ranks_on_node = static_cast<int>(p);
  return w;
}

// What one pair of ring and Ulysses steps says about the ring (run_calibration).
struct RingPair {
  nlohmann::json record;  // the inputs and results, for the calibration's inputs
  double attention = 0;   // the ring's attention at Ulysses' measured rate, s
  double compute = 0;     // the ring's step less its measured wait, projections, per-token term
  double scale = 1;       // its measured wait over the model's
  double share = 1, local = 0;  // core share and local tokens of a rank
};

// The share of a core each of P ranks gets on the calibrated machine.
double core_share(const plan::Calibration& c, int64_t p) {
  return std::min(1.0, static_cast<double>(c.cores) / static_cast<double>(p));
}

}  // namespace

double calibrated_reference_step_s(const plan::Calibration& calibration, int64_t p) {
  const auto inputs = nlohmann::json::parse(calibration.inputs_json);
  const auto key = std::to_string(p);
  if (!inputs.contains("reference_step") || !inputs["reference_step"].contains(key)) return -1;
  return inputs["reference_step"][key].get<double>();
}

plan::Calibration run_calibration(const CalibrateOptions& o) {
  plan::Calibration c;
  c.link = o.link;
  c.cores = common::available_cores();
  nlohmann::json inputs;
  inputs["comm_sizes_bytes"] = {o.small_bytes, o.large_bytes};
  for (int p : {2, 4}) {
    std::map<std::string, std::vector<std::pair<double, double>>> points;  // kind -> (bytes, s)
    for (int64_t bytes : {o.small_bytes, o.large_bytes}) {
      const std::string cmd = common::str_cat(o.self_exe, " comm --nproc ", p, " --bytes ", bytes,
                                              " --iters ", o.comm_iters, o.child_flags, " --json");
      std::printf("hp-bench calibrate: %s\n", shown_command(cmd, o.self_exe).c_str());
      std::fflush(stdout);
      auto j = nlohmann::json::parse(run_for_json(cmd));
      inputs["comm"].push_back({{"command", shown_command(cmd, o.self_exe)}, {"result", j}});
      for (const auto& r : j["results"]) {
        points[r["op"]].emplace_back(r["bytes_sent_per_rank"].get<double>(),
                                     r["median_s"].get<double>());
      }
    }
    for (auto& [kind, pts] : points) {
      HP_INTERNAL_ASSERT(pts.size() == 2, "two sizes per kind");
      bool through_origin = false;
      c.collectives[kind][p] = plan::fit_collective_line(pts[0].first, pts[0].second, pts[1].first,
                                                         pts[1].second, &through_origin);
      inputs["comm_fit"][kind][std::to_string(p)] =
          through_origin ? "through_origin_and_large" : "two_points";
    }
  }
  {
    common::ScopedBlasThreads one(1);
    at::set_num_threads(1);
    AttentionBenchOptions a;
    a.seq = 4096;
    a.heads = 8;
    a.kv_heads = 8;
    a.head_dim = 64;
    a.causal = true;
    // The median of 5 steps (about 2.5 s each): a transient slowdown of the shared machine in
    // one or two of them does not move the rate every prediction divides by (a median of 2,
    // i.e. their mean, once read 17 GFLOP/s for a kernel that runs at 25).
    a.iters = 5;
    std::printf("hp-bench calibrate: one-thread blockwise attention S=4096 and matmul\n");
    std::fflush(stdout);
    auto r = run_attention_bench(a, "blockwise");
    c.attention_gflops = r.fwd_bwd_gflops;
    c.matmul_gflops = measure_matmul_gflops();
    inputs["attention"] = {{"seq", a.seq},
                           {"iters", a.iters},
                           {"heads", a.heads},
                           {"head_dim", a.head_dim},
                           {"causal", true},
                           {"threads", 1},
                           {"fwd_bwd_s", r.fwd_bwd_s},
                           {"fwd_bwd_samples_s", r.fwd_bwd_samples_s},
                           {"gflops", c.attention_gflops},
                           {"matmul_gflops", c.matmul_gflops}};
  }
  // `hp-bench cp` with `args` (logged): the command and its JSON.
  auto run_cp = [&](const std::string& args) {
    std::string cmd = common::str_cat(o.self_exe, " cp ", args, o.child_flags, " --json");
    std::printf("hp-bench calibrate: %s\n", shown_command(cmd, o.self_exe).c_str());
    std::fflush(stdout);
    auto j = nlohmann::json::parse(run_for_json(cmd));
    return std::make_pair(shown_command(cmd, o.self_exe), j);
  };
  // The reference step of a run at P ranks (--reference-step), for the report's speed factor.
  inputs["reference_step"] = {{"seq", kReferenceStepSeq}};
  auto record_reference = [&](int64_t p, const nlohmann::json& j) {
    inputs["reference_step"][std::to_string(p)] = j["results"][0]["reference_step_s"];
  };
  // The attention rate ranks reach and the per-token overhead: one CP layer outside the
  // report's grid (P = 2, ulysses, sync, causal, projections) at two lengths (median of 5 steps
  // each). What a step took beyond the predicted exposed communication and projections is
  // fitted as (its attention at the one-process rate above) * x + local tokens *
  // seconds_per_token: the quadratic part gives x, how much slower the ranks' attention runs
  // than one process alone (page faults, comm threads, the other rank on the machine: 1.3-1.5x
  // on a 2-core VM with the AVX-512 tile GEMM, where a single length's residual, counted per
  // token, once grew 20x and moved every prediction), the linear part what remains per token.
  // The longer run alternates its Ulysses steps with balanced ring steps (the ring's fit below).
  nlohmann::json ring_pairs;
  {
    constexpr int64_t p = 2;
    struct Point {
      double measured = 0, attention = 0, rest = 0, tokens = 0;
    };
    std::vector<Point> pts;
    nlohmann::json runs = nlohmann::json::array();
    plan::Calibration flops = c;  // the one-process rate, no per-token term
    flops.seconds_per_token = 0;
    cp::ContextParallelConfig cfg;
    cfg.algorithm = cp::CPAlgorithm::kUlysses;
    for (int64_t seq : {int64_t{2048}, int64_t{8192}}) {
      const bool paired = seq == 8192;
      const auto [cmd, j] = run_cp(common::str_cat(
          "--cp ", p, " --seq ", seq, " --heads 8 --kv-heads 8 --head-dim 64 --cp-algo ",
          paired ? "ring --load-balance --paired-with ulysses" : "ulysses",
          " --schedule sync --projections --causal --iters 5", paired ? "" : " --reference-step"));
      if (paired) ring_pairs = {{"command", cmd}, {"result", j}};
      if (!paired) record_reference(p, j);
      plan::CPWorkload w = calibration_workload(seq, p);
      const auto with = plan::predict_cp_step(flops, *cp::normalize(cfg, p), p, w);
      w.projections = false;
      const auto without = plan::predict_cp_step(flops, *cp::normalize(cfg, p), p, w);
      Point pt;
      pt.measured = j["results"][0]["step_time_s"];
      pt.attention = without.compute_s;
      pt.rest = with.exposed_comm_s + (with.compute_s - without.compute_s);
      pt.tokens = static_cast<double>(seq / p) / core_share(c, p);
      pts.push_back(pt);
      runs.push_back({{"command", cmd},
                      {"measured_step_s", pt.measured},
                      {"attention_at_one_process_rate_s", pt.attention},
                      {"exposed_comm_and_projections_s", pt.rest},
                      {"local_tokens_per_core", pt.tokens}});
    }
    const Point &a = pts[0], &b = pts[1];
    const double ra = a.measured - a.rest, rb = b.measured - b.rest;
    double x = (rb * a.tokens - ra * b.tokens) / (b.attention * a.tokens - a.attention * b.tokens);
    double per_token = (ra - a.attention * x) / a.tokens;
    if (per_token < 0) {  // all of it quadratic: the longer run's residual is attention
      per_token = 0;
      x = rb / b.attention;
    }
    if (!(x > 0)) {  // a residual below the one-process attention: keep the one-process rate
      x = 1;
      per_token = std::max(0.0, (ra - a.attention) / a.tokens);
    }
    const double one_process = c.attention_gflops;
    c.attention_gflops = one_process / x;
    c.seconds_per_token = per_token;
    inputs["overhead"] = {{"runs", runs},
                          {"one_process_attention_gflops", one_process},
                          {"slowdown_in_ranks", x},
                          {"attention_gflops", c.attention_gflops},
                          {"seconds_per_token", c.seconds_per_token}};
  }
  // The ring, from sync ring steps (balanced) timed in alternation with sync Ulysses steps
  // (causal, projections), which do the same attention work per rank; the ring's step is
  // Ulysses' over the paired ratio (median of 5), so a slow spell of the machine hits both
  // alike. Ulysses' compute (its step minus its measured wait and the predicted projections and
  // per-token term) is its attention; the ring's, likewise, over it times the flop ratio (1:
  // hp-bench runs the blockwise primitive, whose ring backward recomputes nothing) is
  // ring_attention_factor (P = 2, S = 8192: the ring's shifts mostly hidden, its attention
  // long). The ring's measured wait over the one the model predicts is ring_exposed_scale for
  // a ring of P members (2 there, 4 from the pairs at P = 4, S = 4096), and what the ring's step at
  // P = 4 takes beyond its scaled attention, the projections, the per-token term and its wait, per
  // local token per step at one core, is ring_seconds_per_token_step.
  auto ring_pair = [&](int64_t p, int64_t seq, const std::string& cmd, const nlohmann::json& j) {
    const auto& u = j["results"][0];
    const auto& r = j["results"][1];
    const double u_step = u["step_time_s"], ratio = r["paired_speedup"];
    const double ring_step = u_step / ratio;
    plan::CPWorkload w = calibration_workload(seq, p);
    w.load_balance = true;
    cp::ContextParallelConfig ucfg, rcfg;
    ucfg.algorithm = cp::CPAlgorithm::kUlysses;
    rcfg.algorithm = cp::CPAlgorithm::kRing;
    rcfg.load_balance = true;
    rcfg.load_balance_form = cp::LoadBalanceForm::kDataOrder;
    plan::Calibration flops = c;  // flops only, the scale at P not yet applied
    flops.seconds_per_token = 0;
    flops.ring_seconds_per_token_step = 0;
    flops.ring_exposed_scale[p] = 1;
    auto predict = [&](const cp::ContextParallelConfig& cfg, bool projections) {
      plan::CPWorkload wp = w;
      wp.projections = projections;
      return plan::predict_cp_step(flops, *cp::normalize(cfg, p), p, wp);
    };
    const double share = core_share(c, p);
    const double local = static_cast<double>(seq / p);
    // The projections and the per-token term: the same for both.
    const double rest = predict(ucfg, true).compute_s - predict(ucfg, false).compute_s +
                        c.seconds_per_token * local / share;
    const double u_attn = u_step - u["exposed_comm_s"].get<double>() - rest;
    // The ring's attention at Ulysses' measured rate (its factor taken out again).
    const double ring_attn = u_attn * predict(rcfg, false).compute_s / c.ring_attention_factor /
                             predict(ucfg, false).compute_s;
    const double ring_wait = r["exposed_comm_s"];
    const double ring_compute = ring_step - ring_wait - rest;
    const double predicted_wait = predict(rcfg, true).exposed_comm_s;
    // Where the model hides every shift (loopback), or noise left no wait, the scale stays 1.
    const double scale =
        predicted_wait > 1e-3 ? std::clamp(ring_wait / predicted_wait, 0.1, 2.0) : 1.0;
    nlohmann::json rec = {{"command", cmd},
                          {"ulysses_step_s", u_step},
                          {"ulysses_exposed_comm_s", u["exposed_comm_s"]},
                          {"ulysses_over_ring_paired", ratio},
                          {"ring_exposed_comm_s", ring_wait},
                          {"ring_exposed_predicted_s", predicted_wait},
                          {"ring_exposed_scale", scale},
                          {"projections_and_tokens_s", rest},
                          {"ring_attention_at_ulysses_rate_s", ring_attn},
                          {"ring_compute_s", ring_compute}};
    return RingPair{rec, ring_attn, ring_compute, scale, share, local};
  };
  {
    constexpr int64_t p = 2, seq = 8192;
    const std::string cmd = ring_pairs["command"];
    // The factor first (the model's wait depends on it), then the scale with it.
    const auto first = ring_pair(p, seq, cmd, ring_pairs["result"]);
    c.ring_attention_factor = first.attention > 0 && first.compute > 0
                                  ? std::clamp(first.compute / first.attention, 0.5, 3.0)
                                  : 1.0;
    auto fit = ring_pair(p, seq, cmd, ring_pairs["result"]);
    c.ring_exposed_scale[p] = fit.scale;
    fit.record["ring_attention_factor"] = c.ring_attention_factor;
    inputs["ring_attention"] = fit.record;
  }
  {
    constexpr int64_t p = 4, seq = 4096;
    const auto [cmd, j] = run_cp(common::str_cat(
        "--cp ", p, " --seq ", seq, " --heads 8 --kv-heads 8 --head-dim 64 --cp-algo ring ",
        "--load-balance --paired-with ulysses --schedule sync --projections --causal --iters 5 ",
        "--reference-step"));
    record_reference(p, j);
    auto fit = ring_pair(p, seq, cmd, j);
    c.ring_exposed_scale[p] = fit.scale;
    const double beyond = fit.compute - fit.attention * c.ring_attention_factor;
    c.ring_seconds_per_token_step =
        std::max(0.0, beyond) * fit.share / (fit.local * static_cast<double>(p - 1));
    fit.record["ring_attention_s"] = fit.attention * c.ring_attention_factor;
    fit.record["beyond_s"] = beyond;
    fit.record["ring_seconds_per_token_step"] = c.ring_seconds_per_token_step;
    inputs["ring_steps"] = fit.record;
  }
  // The async schedule's own cost: sync and async steps timed in pairs (S = 4096, P = 2,
  // projections), all_gather balanced and Ulysses. What async lost against sync beyond the
  // waits it removed, per local token at one core.
  auto async_overhead = [&](const std::string& algorithm_args, const char* key) {
    const auto [cmd, j] = run_cp(
        common::str_cat("--cp 2 --seq 4096 --heads 8 --kv-heads 8 --head-dim 64 ", algorithm_args,
                        " --schedule async --projections --causal --iters 5"));
    const auto& sync = j["results"][0];
    const auto& async = j["results"][1];
    const double sync_s = sync["step_time_s"], ratio = async["async_speedup"];
    const double hidden =
        std::max(0.0, sync["exposed_comm_s"].get<double>() - async["exposed_comm_s"].get<double>());
    const double lost = sync_s / ratio - sync_s + hidden;
    const double per_token = std::max(0.0, lost) * core_share(c, 2) / (4096.0 / 2.0);
    inputs[key] = {
        {"command", cmd},          {"sync_step_s", sync_s}, {"sync_over_async_paired", ratio},
        {"hidden_wait_s", hidden}, {"lost_s", lost},        {"seconds_per_token", per_token}};
    return per_token;
  };
  c.async_seconds_per_token =
      async_overhead("--cp-algo all_gather --load-balance", "async_overhead");
  c.ulysses_async_seconds_per_token = async_overhead("--cp-algo ulysses", "ulysses_async_overhead");
  c.inputs_json = inputs.dump();
  return c;
}

}  // namespace hp::bench
