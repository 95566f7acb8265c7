// hp-bench linear: one linear-attention mixer (GDN, KDA), alone or under CP over local rank
// processes, forward and forward + backward (bench/linear_bench.h says what is counted).
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/bench/linear_bench.h"
#include "hp/comm/launch_env.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "hp_bench_cmds.h"

namespace hp_bench {

CLI::App* add_linear_command(CLI::App& app, LinearArgs& a) {
  auto& b = a.bench;
  auto* cmd = app.add_subcommand("linear", "one linear-attention mixer (gdn | kda), fwd, fwd+bwd");
  cmd->add_option("--mixer", b.mixer, "gdn | kda");
  cmd->add_option("--seq", b.seq, "sequence length T (global)")->check(CLI::PositiveNumber);
  cmd->add_option("--heads", b.heads, "q/k heads H")->check(CLI::PositiveNumber);
  cmd->add_option("--value-heads", b.value_heads, "value heads HV (default H)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--head-dim", b.head_dim, "key dim K")->check(CLI::PositiveNumber);
  cmd->add_option("--value-dim", b.value_dim, "value dim V (default K)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--batch", b.batch, "batch B")->check(CLI::PositiveNumber);
  cmd->add_option("--chunk-size", b.chunk_size, "tokens per chunk")->check(CLI::PositiveNumber);
  cmd->add_option("--kernel", b.kernel, "chunked | recurrent");
  cmd->add_option("--cp,--nproc", a.nproc, "CP ranks (local processes)")->check(CLI::Range(1, 64));
  cmd->add_option("--cp-mode", b.mode, "ulysses | state_passing");
  cmd->add_option("--state-exchange", b.state_exchange, "all_gather | p2p (state_passing)");
  cmd->add_option("--iters", b.iters, "timed iterations")->check(CLI::Range(1, 1000));
  cmd->add_option("--timeout", a.timeout_s, "per-group timeout in seconds")->capture_default_str();
  cmd->add_flag("--json", a.json, "one JSON object on stdout");
  return cmd;
}

namespace {

nlohmann::json linear_json(const LinearArgs& a, const hp::bench::LinearBenchResult& r,
                           int threads) {
  const auto& b = a.bench;
  nlohmann::json j = {
      {"mixer", b.mixer},
      {"kernel", b.kernel},
      {"cp", r.cp},
      {"batch", b.batch},
      {"seq", b.seq},
      {"heads", b.heads},
      {"value_heads", b.value_heads > 0 ? b.value_heads : b.heads},
      {"head_dim", b.head_dim},
      {"value_dim", b.value_dim > 0 ? b.value_dim : b.head_dim},
      {"chunk_size", b.chunk_size},
      {"threads_per_rank", threads},
      {"fwd_s", r.fwd_s},
      {"fwd_bwd_s", r.fwd_bwd_s},
      {"flops_fwd", r.flops_fwd},
      {"flops_counted", "chunked-algorithm matmuls, analytic; fwd+bwd = 3x fwd; per rank = 1/cp"},
      {"fwd_gflops", r.fwd_gflops},
      {"fwd_bwd_gflops", r.fwd_bwd_gflops},
      {"matmul_gflops", r.matmul_gflops},
      {"fwd_bwd_fraction_of_matmul", r.matmul_gflops > 0 ? r.fwd_bwd_gflops / r.matmul_gflops : 0},
      {"comm_bytes_per_rank", r.comm_bytes_per_rank},
      {"comm_bytes_theory", r.comm_bytes_theory},
      {"peak_rss_bytes", r.peak_rss_bytes},
      {"peak_rss_per_rank", r.peak_rss_per_rank}};
  if (r.cp > 1) j["cp_mode"] = b.mode;
  if (r.cp > 1 && b.mode == "state_passing") j["state_exchange"] = b.state_exchange;
  return j;
}

void print_linear(const LinearArgs& a, const hp::bench::LinearBenchResult& r, int threads) {
  const auto& b = a.bench;
  const std::string cp =
      r.cp > 1 ? hp::common::str_cat(" cp=", r.cp, " ", b.mode,
                                     b.mode == "state_passing" ? "/" + b.state_exchange : "")
               : std::string(" (no CP)");
  std::printf(
      "hp-bench linear: %s %s B=%lld T=%lld H=%lld HV=%lld K=%lld V=%lld C=%lld%s (%d thread(s) "
      "per rank)\n  fwd %.3f s, fwd+bwd %.3f s (medians, slowest rank)\n  chunked-algorithm "
      "matmul FLOPs (analytic, fwd+bwd = 3x fwd): %.1f / %.1f GFLOP/s per rank (fwd / fwd+bwd) "
      "vs %.1f GFLOP/s batched [64,128]x[128,128] matmul (%.0f%%)\n  comm %lld bytes/rank per "
      "fwd+bwd (formula %lld); peak RSS %.0f MiB (max rank)\n",
      b.mixer.c_str(), b.kernel.c_str(), (long long)b.batch, (long long)b.seq, (long long)b.heads,
      (long long)(b.value_heads > 0 ? b.value_heads : b.heads), (long long)b.head_dim,
      (long long)(b.value_dim > 0 ? b.value_dim : b.head_dim), (long long)b.chunk_size, cp.c_str(),
      threads, r.fwd_s, r.fwd_bwd_s, r.fwd_gflops, r.fwd_bwd_gflops, r.matmul_gflops,
      r.matmul_gflops > 0 ? 100.0 * r.fwd_bwd_gflops / r.matmul_gflops : 0.0,
      (long long)(r.comm_bytes_per_rank.empty() ? 0 : r.comm_bytes_per_rank[0]),
      (long long)r.comm_bytes_theory, r.peak_rss_bytes / 1048576.0);
}

}  // namespace

int run_linear(const LinearArgs& a, const std::vector<std::string>& argv) {
  hp::bench::check_linear_bench(a.bench, a.nproc);  // before any process starts
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "linear");
  auto world = join_world(env, a.timeout_s);
  const int threads = hp::common::threads_per_rank(world.local_size());
  const auto r = hp::bench::run_linear_bench(world, a.bench);
  if (world.rank() != 0) return 0;
  if (a.json) {
    std::cout << linear_json(a, r, threads).dump() << std::endl;
  } else {
    print_linear(a, r, threads);
  }
  return 0;
}

}  // namespace hp_bench
