// hp-bench moe: one MoE MLP layer, its experts split over the ranks (EP) and, in the same run,
// every expert on every rank (bench/moe_bench.h says what is counted).
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/bench/link.h"
#include "hp/bench/moe_bench.h"
#include "hp/comm/launch_env.h"
#include "hp/comm/world.h"
#include "hp/common/threads.h"
#include "hp_bench_cmds.h"

namespace hp_bench {

CLI::App* add_moe_command(CLI::App& app, MoEArgs& a) {
  auto& b = a.bench;
  auto* cmd = app.add_subcommand("moe", "one MoE MLP layer, expert parallel vs every expert local");
  cmd->add_option("--tokens", b.tokens, "tokens per rank")->check(CLI::PositiveNumber);
  cmd->add_option("--hidden", b.hidden, "model width H")->check(CLI::PositiveNumber);
  cmd->add_option("--expert-ffn", b.expert_ffn, "each expert's SwiGLU width")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--experts", b.experts, "experts E")->check(CLI::PositiveNumber);
  cmd->add_option("--top-k", b.top_k, "experts per token")->check(CLI::PositiveNumber);
  cmd->add_option("--ep,--nproc", a.nproc, "EP ranks (local processes)")->check(CLI::Range(1, 64));
  cmd->add_option("--iters", b.iters, "timed iterations")->check(CLI::Range(1, 1000));
  cmd->add_option("--timeout", a.timeout_s, "per-group timeout in seconds")->capture_default_str();
  cmd->add_flag("--json", a.json, "one JSON object on stdout");
  return cmd;
}

int run_moe(const MoEArgs& a, const std::vector<std::string>& argv) {
  hp::bench::check_moe_bench(a.bench, a.nproc);  // before any process starts
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "moe");
  auto world = join_world(env, a.timeout_s);
  const int threads = hp::common::threads_per_rank(world.local_size());
  const auto r = hp::bench::run_moe_bench(world, a.bench);
  if (world.rank() != 0) return 0;
  const auto& b = a.bench;
  const auto link = hp::bench::emulated_link_rate().value_or("loopback");
  if (a.json) {
    nlohmann::json j = {{"ep", r.ep},
                        {"tokens_per_rank", b.tokens},
                        {"hidden", b.hidden},
                        {"expert_ffn", b.expert_ffn},
                        {"experts", b.experts},
                        {"top_k", b.top_k},
                        {"link", link},
                        {"threads_per_rank", threads},
                        {"ep_fwd_bwd_s", r.ep_s},
                        {"local_fwd_bwd_s", r.local_s},
                        {"exposed_dispatch_combine_s", r.exposed_s},
                        {"ep_minus_local_s", r.vs_local_s},
                        {"ep_tokens_per_s", r.ep_tokens_per_s},
                        {"local_tokens_per_s", r.local_tokens_per_s},
                        {"a2a_bytes_per_rank", r.a2a_bytes_per_rank},
                        {"formula_bytes_per_rank", r.formula_bytes_per_rank},
                        {"uniform_bytes_per_rank", r.uniform_bytes_per_rank},
                        {"peak_rss_bytes", r.peak_rss_bytes}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::printf(
      "hp-bench moe: E=%lld top-%lld H=%lld F=%lld, %lld tokens per rank, ep=%lld over %s (%d "
      "thread(s) per rank)\n  expert parallel: fwd+bwd %.3f s, %.0f tokens/s\n  every expert "
      "local: fwd+bwd %.3f s, %.0f tokens/s\n  exposed dispatch/combine: %.3f s (%.0f%% of the EP "
      "step; blocked in the all-to-alls, slowest rank); EP - local = %+.3f s\n",
      (long long)b.experts, (long long)b.top_k, (long long)b.hidden, (long long)b.expert_ffn,
      (long long)b.tokens, (long long)r.ep, link.c_str(), threads, r.ep_s, r.ep_tokens_per_s,
      r.local_s, r.local_tokens_per_s, r.exposed_s, r.ep_s > 0 ? 100 * r.exposed_s / r.ep_s : 0.0,
      r.vs_local_s);
  for (size_t i = 0; i < r.a2a_bytes_per_rank.size(); ++i) {
    std::printf("  rank %zu: all-to-all %lld bytes per fwd+bwd (formula from the routing %lld)\n",
                i, (long long)r.a2a_bytes_per_rank[i], (long long)r.formula_bytes_per_rank[i]);
  }
  std::printf("  uniform routing would move %lld bytes per rank; peak RSS %.0f MiB (max rank)\n",
              (long long)r.uniform_bytes_per_rank, r.peak_rss_bytes / 1048576.0);
  return 0;
}

}  // namespace hp_bench
