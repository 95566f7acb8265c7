// hp-bench: measurements, never pass/fail tests.
//   hp-bench comm --nproc N [--bytes B] [--iters K] [--json]
//   hp-bench attention --seq S --heads H --kv-heads HK --head-dim D [--causal] [--batch B]
//                      [--primitive math|blockwise|all] [--iters K] [--json]
//   hp-bench cp --seq S --heads H --kv-heads HK --head-dim D --cp P --cp-algo A
//               [--ulysses-degree U] [--schedule sync|async] [--causal] [--iters K] [--json]
//   hp-bench hsdp --nproc N --dp-shard Sd --dp-replicate R [--comm-fusion on|off]
//                 [--layers L --hidden H --ffn F --seq S] [--iters K] [--json]
// comm, cp and hsdp take --link-rate RATE: all ranks run in a network namespace whose loopback
// is rate-limited (tc tbf); needs root and iproute2.
// With --nproc N (N > 1) it spawns N local rank processes of itself; under torchrun / mpirun /
// Slurm variables it is one rank of that job.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/attention/attention.h"
#include "hp/bench/attention_bench.h"
#include "hp/bench/calibrate.h"
#include "hp/bench/comm_bench.h"
#include "hp/bench/cp_bench.h"
#include "hp/bench/hsdp_bench.h"
#include "hp/bench/link.h"
#include "hp/comm/launch_env.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "hp/common/trace.h"
#include "hp/plan/cost_model.h"
#include "hp/train/launcher.h"

namespace {

// The attention shape options both `attention` and `cp` take.
void add_shape_options(CLI::App* cmd, int64_t& seq, int64_t& heads, int64_t& kv_heads,
                       int64_t& head_dim, int64_t& batch) {
  cmd->add_option("--seq", seq, "sequence length S (global)")->check(CLI::PositiveNumber);
  cmd->add_option("--heads", heads, "query heads H")->check(CLI::PositiveNumber);
  cmd->add_option("--kv-heads", kv_heads, "key/value heads")->check(CLI::PositiveNumber);
  cmd->add_option("--head-dim", head_dim, "head dim D")->check(CLI::PositiveNumber);
  cmd->add_option("--batch", batch, "batch B")->check(CLI::PositiveNumber);
}

int launch_self(int nproc, const std::vector<std::string>& argv, const char* what) {
  return hp::train::relaunch_as_local_ranks(nproc, argv, std::string("hp-bench ") + what);
}

struct CommArgs {
  int nproc = 1;
  hp::bench::CommBenchOptions bench;
  bool json = false;
  double timeout_s = 300;
  std::string trace;  // Chrome-trace file, one track per rank
};

void print_comm(const std::vector<hp::bench::CommBenchResult>& results, int nproc, bool json) {
  if (json) {
    nlohmann::json out = {{"nproc", nproc},
                          {"link", hp::bench::emulated_link_rate().value_or("loopback")},
                          {"results", nlohmann::json::array()}};
    for (const auto& r : results) {
      out["results"].push_back({{"op", r.op},
                                {"bytes_in", r.bytes_in},
                                {"bytes_sent_per_rank", r.bytes_sent_per_rank},
                                {"theory_bytes_per_rank", r.theory_bytes_per_rank},
                                {"median_s", r.median_s},
                                {"gbps", r.gbps},
                                {"wire_bytes_per_rank", r.wire_bytes_per_rank}});
    }
    std::cout << out.dump() << std::endl;
    return;
  }
  const auto link = hp::bench::emulated_link_rate();
  std::printf("hp-bench comm: %d ranks, link %s, median of the slowest rank\n", nproc,
              link ? (*link + " (emulated)").c_str() : "loopback");
  std::printf("%-15s %14s %20s %22s %10s %8s%s\n", "op", "bytes_in", "bytes_sent_per_rank",
              "theory_bytes_per_rank", "median_ms", "GB/s", link ? "   wire_bytes_per_rank" : "");
  for (const auto& r : results) {
    std::printf("%-15s %14lld %20lld %22lld %10.2f %8.3f", r.op.c_str(),
                static_cast<long long>(r.bytes_in), static_cast<long long>(r.bytes_sent_per_rank),
                static_cast<long long>(r.theory_bytes_per_rank), r.median_s * 1e3, r.gbps);
    if (link) std::printf(" %21lld", static_cast<long long>(r.wire_bytes_per_rank));
    std::printf("\n");
  }
  std::fflush(stdout);
}

int run_comm(const CommArgs& a, const std::vector<std::string>& argv) {
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "comm");
  hp::comm::WorldOptions wo;
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  if (!a.trace.empty()) wo.tracer = std::make_shared<hp::common::Tracer>();
  hp::comm::World world = env ? hp::comm::World::from_launch_env(*env, wo)
                              : hp::comm::World::from_launch_env(hp::comm::LaunchEnv{}, wo);
  hp::common::configure_threads(hp::common::threads_per_rank(world.local_size()));
  auto results = hp::bench::run_comm_bench(world, a.bench);
  if (!a.trace.empty()) hp::comm::write_world_trace(world, a.trace);
  if (world.rank() == 0) print_comm(results, world.size(), a.json);
  return 0;
}

struct AttentionArgs {
  hp::bench::AttentionBenchOptions bench;
  std::string primitive = "all";
  bool json = false;
  bool child = false;  // internal: run one primitive and print its result as JSON
};

nlohmann::json to_json(const hp::bench::AttentionBenchResult& r) {
  return {{"primitive", r.primitive},           {"fwd_s", r.fwd_s},
          {"fwd_bwd_s", r.fwd_bwd_s},           {"fwd_gflops", r.fwd_gflops},
          {"fwd_bwd_gflops", r.fwd_bwd_gflops}, {"peak_bytes", r.peak_bytes},
          {"peak_rss_bytes", r.peak_rss_bytes}};
}

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

// Runs one primitive in a fresh process of this binary, so each gets its own peak RSS.
nlohmann::json run_attention_child(const AttentionArgs& a, const std::string& primitive) {
  const auto& b = a.bench;
  std::string cmd = hp::common::str_cat(
      hp::train::self_executable(), " attention --child --primitive ", primitive, " --seq ", b.seq,
      " --heads ", b.heads, " --kv-heads ", b.kv_heads, " --head-dim ", b.head_dim, " --batch ",
      b.batch, " --iters ", b.iters, " --block-q ", b.block_q, " --block-kv ", b.block_kv,
      b.causal ? " --causal" : "");
  FILE* pipe = ::popen(cmd.c_str(), "r");
  HP_CHECK(pipe != nullptr, "hp-bench attention: cannot start ", cmd);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0)
    out.append(buf, n);
  const int rc = ::pclose(pipe);
  HP_CHECK(rc == 0, "hp-bench attention: primitive '", primitive, "' failed: ", out);
  return nlohmann::json::parse(out);
}

int run_attention(const AttentionArgs& a) {
  const auto& b = a.bench;
  if (a.child) {
    hp::common::configure_threads(hp::common::available_cores());
    std::cout << to_json(hp::bench::run_attention_bench(b, a.primitive)).dump() << std::endl;
    return 0;
  }
  std::vector<std::string> prims;
  if (a.primitive == "all") {
    prims = hp::attention::AttentionRegistry::builtin().names();
  } else {
    hp::attention::AttentionRegistry::builtin().get(a.primitive);  // clear error if unknown
    prims = {a.primitive};
  }
  const double gflops = hp::bench::measure_matmul_gflops();
  nlohmann::json out = {{"seq", b.seq},
                        {"heads", b.heads},
                        {"kv_heads", b.kv_heads},
                        {"head_dim", b.head_dim},
                        {"batch", b.batch},
                        {"causal", b.causal},
                        {"matmul_gflops", gflops},
                        {"results", nlohmann::json::array()},
                        {"skipped", nlohmann::json::array()}};
  for (const auto& p : prims) {
    if (p == "math" && hp::bench::math_score_bytes(b) > available_memory_bytes() * 6 / 10) {
      const std::string why =
          hp::common::str_cat("math needs about ", hp::bench::math_score_bytes(b) >> 20,
                              " MiB for its [B, H, S, S] "
                              "scores; only ",
                              available_memory_bytes() >> 20, " MiB are available");
      HP_CHECK(a.primitive == "all", "hp-bench attention: ", why, "; use --primitive blockwise");
      out["skipped"].push_back({{"primitive", p}, {"reason", why}});
      continue;
    }
    out["results"].push_back(run_attention_child(a, p));
  }
  if (a.json) {
    std::cout << out.dump() << std::endl;
    return 0;
  }
  std::printf(
      "hp-bench attention: B=%lld H=%lld Hkv=%lld D=%lld S=%lld causal=%s; "
      "fp32 matmul roofline %.1f GFLOP/s (2048^3, this run)\n",
      (long long)b.batch, (long long)b.heads, (long long)b.kv_heads, (long long)b.head_dim,
      (long long)b.seq, b.causal ? "yes" : "no", gflops);
  std::printf("%-10s %10s %12s %11s %15s %9s %12s\n", "primitive", "fwd_s", "fwd_bwd_s", "fwd_GF/s",
              "fwd_bwd_GF/s", "%roof", "peak_MiB");
  for (const auto& r : out["results"]) {
    std::printf("%-10s %10.3f %12.3f %11.1f %15.1f %8.1f%% %12.1f\n",
                r["primitive"].get<std::string>().c_str(), r["fwd_s"].get<double>(),
                r["fwd_bwd_s"].get<double>(), r["fwd_gflops"].get<double>(),
                r["fwd_bwd_gflops"].get<double>(),
                100.0 * r["fwd_bwd_gflops"].get<double>() / gflops,
                r["peak_rss_bytes"].get<int64_t>() / 1048576.0);
  }
  for (const auto& s : out["skipped"]) {
    std::printf("%-10s skipped: %s\n", s["primitive"].get<std::string>().c_str(),
                s["reason"].get<std::string>().c_str());
  }
  return 0;
}

struct CPArgs {
  hp::bench::CPBenchOptions bench;
  int nproc = 2;
  std::string algo = "all_gather", schedule = "sync";
  int64_t degree = 0;
  bool json = false;
  double timeout_s = 600;
};

// --cp-algo auto: the cost model's fastest legal choice for this link; every candidate's
// prediction is logged (once, by the launching process).
void choose_cp_config(CPArgs& a, bool log) {
  const std::string link = hp::bench::emulated_link_rate().value_or("loopback");
  auto cal = hp::plan::load_calibration(hp::plan::default_calibration_path(link));
  hp::plan::CPWorkload w;
  w.seq = a.bench.seq;
  w.heads = a.bench.heads;
  w.kv_heads = a.bench.kv_heads;
  w.head_dim = a.bench.head_dim;
  w.batch = a.bench.batch;
  w.causal = a.bench.causal;
  w.projections = a.bench.projections;
  w.load_balance = a.bench.config.load_balance;
  w.ranks_on_node = a.nproc;
  auto ranked = hp::plan::rank_cp_configs(cal, a.nproc, w);
  if (log) {
    std::printf("hp-bench cp: --cp-algo auto on link %s (calibration %s):\n", link.c_str(),
                hp::plan::default_calibration_path(link).c_str());
    for (const auto& r : ranked)
      std::printf("  %s\n", hp::plan::describe(r).c_str());
    std::printf("  chosen: %s\n", ranked.front().name.c_str());
    std::fflush(stdout);
  }
  const auto& best = ranked.front().config;
  a.algo = hp::cp::to_string(best.algorithm);
  a.schedule = hp::cp::to_string(best.schedule);
  a.degree = best.algorithm == hp::cp::CPAlgorithm::kHybrid ? *best.ulysses_degree : 0;
  a.bench.config.load_balance = best.load_balance;
}

int run_cp(CPArgs a, const std::vector<std::string>& argv) {
  if (a.algo == "auto") {
    choose_cp_config(a, !hp::comm::parse_launch_env(hp::comm::process_env()).has_value());
  }
  a.bench.config.algorithm = hp::cp::parse_algorithm(a.algo);
  a.bench.config.schedule = hp::cp::parse_schedule(a.schedule);
  if (a.degree > 0) a.bench.config.ulysses_degree = a.degree;
  // Static checks before any process starts.
  auto normalized = hp::cp::normalize(a.bench.config, a.nproc);
  if (normalized) {
    hp::cp::check_sequence(*normalized, a.nproc, a.bench.seq);
    hp::cp::check_heads(*normalized, a.nproc, a.bench.heads, a.bench.kv_heads);
  }
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "cp");
  hp::comm::WorldOptions wo;
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  auto world = env ? hp::comm::World::from_launch_env(*env, wo)
                   : hp::comm::World::from_launch_env(hp::comm::LaunchEnv{}, wo);
  hp::common::configure_threads(hp::common::threads_per_rank(world.local_size()));
  auto results = hp::bench::run_cp_bench(world, a.bench);
  if (world.rank() != 0) return 0;
  nlohmann::json list = nlohmann::json::array();
  for (const auto& r : results) {
    list.push_back({{"algorithm", r.algorithm},
                    {"schedule", r.schedule},
                    {"cp", r.cp},
                    {"ulysses_degree", r.ulysses_degree},
                    {"seq", r.seq},
                    {"heads", a.bench.heads},
                    {"kv_heads", a.bench.kv_heads},
                    {"head_dim", a.bench.head_dim},
                    {"causal", a.bench.causal},
                    {"projections", a.bench.projections},
                    {"load_balance", a.bench.config.load_balance},
                    {"threads_per_rank", hp::common::threads_per_rank(world.local_size())},
                    {"step_time_s", r.step_time_s},
                    {"comm_bytes_per_rank", r.comm_bytes_per_rank},
                    {"comm_bytes_theory", r.comm_bytes_theory},
                    {"wire_bytes_per_rank", r.wire_bytes_per_rank},
                    {"link", hp::bench::emulated_link_rate().value_or("loopback")},
                    {"peak_rss_bytes", r.peak_rss_bytes},
                    {"peak_rss_per_rank", r.peak_rss_per_rank},
                    {"per_rank_attention_cpu_s", r.attention_cpu_s_per_rank},
                    {"exposed_comm_s", r.exposed_comm_s},
                    {"overlap_fraction", r.overlap_fraction}});
  }
  if (a.json) {
    std::cout << nlohmann::json{{"results", list}}.dump() << std::endl;
    return 0;
  }
  for (const auto& r : results) {
    std::printf(
        "hp-bench cp: %s %s cp=%lld U=%lld S=%lld H=%lld Hkv=%lld D=%lld causal=%s%s "
        "(%d thread(s) per rank)\n  step %.3f s (median, slowest rank); comm %lld "
        "bytes/rank (formula %lld); peak RSS %.0f MiB (max rank)\n  exposed comm "
        "%.3f s/step%s%s\n",
        r.algorithm.c_str(), r.schedule.c_str(), (long long)r.cp, (long long)r.ulysses_degree,
        (long long)r.seq, (long long)a.bench.heads, (long long)a.bench.kv_heads,
        (long long)a.bench.head_dim, a.bench.causal ? "yes" : "no",
        a.bench.projections ? " +projections" : "",
        hp::common::threads_per_rank(world.local_size()), r.step_time_s,
        (long long)r.comm_bytes_per_rank, (long long)r.comm_bytes_theory,
        r.peak_rss_bytes / 1048576.0, r.exposed_comm_s,
        r.schedule == "async"
            ? hp::common::str_cat(" (overlap fraction ", r.overlap_fraction, ")").c_str()
            : "",
        r.wire_bytes_per_rank >= 0
            ? hp::common::str_cat("; on the wire ", r.wire_bytes_per_rank, " bytes/rank (link ",
                                  hp::bench::emulated_link_rate().value_or("?"), ")")
                  .c_str()
            : "");
    double lo = 1e30, hi = 0;
    std::printf("  attention CPU s per rank:");
    for (double c : r.attention_cpu_s_per_rank) {
      lo = std::min(lo, c);
      hi = std::max(hi, c);
      std::printf(" %.3f", c);
    }
    std::printf("  (max/min %.2f)\n", lo > 0 ? hi / lo : 0.0);
  }
  return 0;
}

struct HsdpArgs {
  hp::bench::HsdpBenchOptions bench;
  int nproc = 2;
  std::string fusion = "off";
  bool json = false;
  double timeout_s = 600;
};

int run_hsdp(HsdpArgs a, const std::vector<std::string>& argv) {
  HP_CHECK(a.fusion == "on" || a.fusion == "off", "hp-bench hsdp: --comm-fusion '", a.fusion,
           "' is not valid; valid: on, off");
  a.bench.comm_fusion = a.fusion == "on";
  HP_CHECK(a.bench.dp_shard * a.bench.dp_replicate == a.nproc, "hp-bench hsdp: --dp-shard ",
           a.bench.dp_shard, " x --dp-replicate ", a.bench.dp_replicate, " = ",
           a.bench.dp_shard * a.bench.dp_replicate, " but --nproc is ", a.nproc,
           "; make the product equal --nproc");
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "hsdp");
  hp::comm::WorldOptions wo;
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  auto world = env ? hp::comm::World::from_launch_env(*env, wo)
                   : hp::comm::World::from_launch_env(hp::comm::LaunchEnv{}, wo);
  const int threads = hp::common::threads_per_rank(world.local_size());
  hp::common::configure_threads(threads);
  auto results = hp::bench::run_hsdp_bench(world, a.bench);
  if (world.rank() != 0) return 0;
  const auto& b = a.bench;
  nlohmann::json list = nlohmann::json::array();
  for (const auto& r : results) {
    list.push_back({{"mode", r.mode},
                    {"forward_s", r.forward_s},
                    {"backward_s", r.backward_s},
                    {"exposed_comm_s", r.exposed_comm_s},
                    {"drain_s", r.drain_s},
                    {"bytes_per_rank",
                     {{"all_gather", r.bytes_all_gather},
                      {"reduce_scatter", r.bytes_reduce_scatter},
                      {"all_reduce", r.bytes_all_reduce}}},
                    {"formula_bytes_per_rank",
                     {{"all_gather", r.formula_all_gather},
                      {"reduce_scatter", r.formula_reduce_scatter},
                      {"all_reduce", r.formula_all_reduce}}},
                    {"param_bytes_per_rank", r.param_bytes_per_rank},
                    {"full_param_bytes", r.full_param_bytes}});
  }
  const double speedup =
      results[1].backward_s > 0 ? results[0].backward_s / results[1].backward_s : 0.0;
  if (a.json) {
    std::cout << nlohmann::json{{"nproc", a.nproc},
                                {"dp_shard", b.dp_shard},
                                {"dp_replicate", b.dp_replicate},
                                {"comm_fusion", a.fusion},
                                {"threads_per_rank", threads},
                                {"model",
                                 {{"layers", b.layers},
                                  {"hidden", b.hidden},
                                  {"ffn", b.ffn},
                                  {"seq", b.seq}}},
                                {"results", list},
                                {"backward_speedup", speedup}}
                     .dump()
              << std::endl;
    return 0;
  }
  std::printf(
      "hp-bench hsdp: R=%lld x Sd=%lld, comm_fusion=%s, %lld layers hidden=%lld ffn=%lld "
      "S=%lld (%d thread(s) per rank; medians of the slowest rank)\n",
      (long long)b.dp_replicate, (long long)b.dp_shard, a.fusion.c_str(), (long long)b.layers,
      (long long)b.hidden, (long long)b.ffn, (long long)b.seq, threads);
  std::printf("%-10s %10s %11s %12s %9s %26s %26s %26s\n", "mode", "forward_s", "backward_s",
              "exposed_s", "drain_s", "all_gather B/rank (form.)", "reduce_scat B (form.)",
              "all_reduce B (form.)");
  for (const auto& r : results) {
    std::printf(
        "%-10s %10.3f %11.3f %12.3f %9.3f %13lld (%10lld) %13lld (%10lld) %13lld (%10lld)\n",
        r.mode.c_str(), r.forward_s, r.backward_s, r.exposed_comm_s, r.drain_s,
        (long long)r.bytes_all_gather, (long long)r.formula_all_gather,
        (long long)r.bytes_reduce_scatter, (long long)r.formula_reduce_scatter,
        (long long)r.bytes_all_reduce, (long long)r.formula_all_reduce);
  }
  std::printf("parameters per rank: %.2f MiB of %.2f MiB (1/%.2f); backward speedup %.2fx\n",
              results[1].param_bytes_per_rank / 1048576.0, results[1].full_param_bytes / 1048576.0,
              static_cast<double>(results[1].full_param_bytes) /
                  static_cast<double>(std::max<int64_t>(1, results[1].param_bytes_per_rank)),
              speedup);
  return 0;
}

int run_calibrate(const std::string& out) {
  hp::bench::CalibrateOptions o;
  o.self_exe = hp::train::self_executable();
  o.link = hp::bench::emulated_link_rate().value_or("loopback");
  auto c = hp::bench::run_calibration(o);
  const auto path = hp::plan::default_calibration_path(o.link);
  hp::plan::save_calibration(path, c);
  if (!out.empty()) hp::plan::save_calibration(out, c);
  std::printf(
      "hp-bench calibrate: link %s, %d cores: attention %.1f GF/s, matmul %.1f GF/s (one "
      "thread)\n",
      o.link.c_str(), c.cores, c.attention_gflops, c.matmul_gflops);
  for (const auto& [kind, by_p] : c.collectives) {
    for (const auto& [p, f] : by_p) {
      std::printf("  %-15s P=%lld: latency %.3f ms, %.3f GB/s per rank\n", kind.c_str(),
                  (long long)p, f.latency_s * 1e3,
                  f.seconds_per_byte > 0 ? 1e-9 / f.seconds_per_byte : 0.0);
    }
  }
  std::printf("hp-bench calibrate: wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  CLI::App app{"hp-bench: hyperparallel benchmarks (medians; compare ratios from one run)"};
  app.require_subcommand(1);
  CommArgs comm;
  auto* c = app.add_subcommand("comm", "collective volume and throughput over local ranks");
  c->add_option("--nproc", comm.nproc, "local rank processes to spawn")->check(CLI::Range(1, 64));
  c->add_option("--bytes", comm.bench.bytes, "input bytes per rank")->check(CLI::PositiveNumber);
  c->add_option("--iters", comm.bench.iters, "timed iterations")->check(CLI::Range(1, 100000));
  c->add_option("--timeout", comm.timeout_s, "per-group timeout in seconds");
  c->add_flag("--json", comm.json, "one JSON object on stdout");
  c->add_option("--trace", comm.trace, "write a Chrome trace (one track per rank) to this file");
  AttentionArgs att;
  auto* at_cmd = app.add_subcommand("attention", "one attention layer, fwd and fwd+bwd");
  add_shape_options(at_cmd, att.bench.seq, att.bench.heads, att.bench.kv_heads, att.bench.head_dim,
                    att.bench.batch);
  at_cmd->add_flag("--causal", att.bench.causal, "causal mask");
  at_cmd->add_option("--primitive", att.primitive, "math | blockwise | sdpa | all");
  at_cmd->add_option("--iters", att.bench.iters, "timed iterations")->check(CLI::Range(1, 1000));
  at_cmd->add_option("--block-q", att.bench.block_q, "blockwise: query rows per tile (0: default)");
  at_cmd->add_option("--block-kv", att.bench.block_kv, "blockwise: key rows per tile (0: default)");
  at_cmd->add_flag("--json", att.json, "one JSON object on stdout");
  at_cmd->add_flag("--child", att.child, "internal")->group("");
  CPArgs cpa;
  auto* cp_cmd = app.add_subcommand("cp", "one CP attention layer, forward + backward");
  add_shape_options(cp_cmd, cpa.bench.seq, cpa.bench.heads, cpa.bench.kv_heads, cpa.bench.head_dim,
                    cpa.bench.batch);
  cp_cmd->add_option("--cp,--nproc", cpa.nproc, "CP ranks (local processes)")
      ->check(CLI::Range(1, 64));
  cp_cmd->add_option("--cp-algo", cpa.algo, "all_gather | ulysses | hybrid | auto");
  cp_cmd->add_option("--ulysses-degree", cpa.degree, "Ulysses degree (hybrid)");
  cp_cmd->add_option("--schedule", cpa.schedule, "sync | async");
  cp_cmd->add_option("--adapter", cpa.bench.adapter, "sdpa_qkv | sdpa_hf | flex_qkv | flex_hf");
  cp_cmd->add_flag("--causal", cpa.bench.causal, "causal attention");
  cp_cmd->add_flag("--projections", cpa.bench.projections,
                   "Q/K/V/O projections around attention (what async overlaps)");
  cp_cmd->add_flag("--load-balance", cpa.bench.config.load_balance,
                   "head-tail load balance (all_gather; data-order shards)");
  cp_cmd->add_option("--iters", cpa.bench.iters, "timed steps")->check(CLI::Range(1, 1000));
  cp_cmd->add_option("--timeout", cpa.timeout_s, "per-group timeout in seconds");
  cp_cmd->add_flag("--json", cpa.json, "one JSON object on stdout");
  HsdpArgs hs;
  auto* hs_cmd = app.add_subcommand("hsdp", "decoder stack backward: HSDP pipeline vs baseline");
  hs_cmd->add_option("--nproc", hs.nproc, "local rank processes")->check(CLI::Range(1, 64));
  hs_cmd->add_option("--dp-shard", hs.bench.dp_shard, "shard degree Sd")
      ->check(CLI::PositiveNumber);
  hs_cmd->add_option("--dp-replicate", hs.bench.dp_replicate, "replicas R")
      ->check(CLI::PositiveNumber);
  hs_cmd->add_option("--comm-fusion", hs.fusion, "on | off");
  hs_cmd->add_option("--layers", hs.bench.layers, "decoder layers")->check(CLI::PositiveNumber);
  hs_cmd->add_option("--hidden", hs.bench.hidden, "hidden size")->check(CLI::PositiveNumber);
  hs_cmd->add_option("--ffn", hs.bench.ffn, "MLP width")->check(CLI::PositiveNumber);
  hs_cmd->add_option("--seq", hs.bench.seq, "tokens per rank")->check(CLI::PositiveNumber);
  hs_cmd->add_option("--iters", hs.bench.iters, "timed steps")->check(CLI::Range(1, 1000));
  hs_cmd->add_option("--timeout", hs.timeout_s, "per-group timeout in seconds");
  hs_cmd->add_flag("--json", hs.json, "one JSON object on stdout");
  auto* cal_cmd =
      app.add_subcommand("calibrate", "measure the CP cost model's inputs for this link; cache");
  std::string cal_out;
  cal_cmd->add_option("--out", cal_out, "also write the calibration here");
  std::string link_rate;
  for (auto* cmd : {c, cp_cmd, hs_cmd, cal_cmd}) {
    cmd->add_option("--link-rate", link_rate,
                    "emulate a link of this rate (e.g. 1gbit) on a namespaced loopback; root");
  }
  CLI11_PARSE(app, argc, argv);
  try {
    if (!link_rate.empty() && !hp::bench::emulated_link_rate()) {
      return hp::bench::run_in_emulated_link(link_rate, args);
    }
    if (hs_cmd->parsed()) return run_hsdp(hs, args);
    if (cal_cmd->parsed()) return run_calibrate(cal_out);
    if (cp_cmd->parsed()) return run_cp(cpa, args);
    if (c->parsed()) return run_comm(comm, args);
    if (at_cmd->parsed()) return run_attention(att);
  } catch (const std::exception& e) {
    std::cerr << "hp-bench: " << e.what() << std::endl;
    hp::train::report_rank_error(e.what());
    return 1;
  }
  return 0;
}
