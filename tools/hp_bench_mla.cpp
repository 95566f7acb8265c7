// hp-bench cp --attention mla: MLA's core under CP (bench/mla_bench.h).
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/bench/link.h"
#include "hp/comm/launch_env.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "hp/cp/config.h"
#include "hp_bench_cmds.h"

namespace hp_bench {

void add_mla_options(CLI::App* cmd, CPArgs& a) {
  cmd->add_option("--attention", a.attention,
                  "softmax (default) | mla: MLA's core (--cp-algo latent_all_gather | ulysses | "
                  "all_gather; default: latent_all_gather and all_gather in one run) | dsa: "
                  "sparse attention + indexer + loss beside dense MLA of the same shape");
  cmd->add_option("--d-nope", a.mla.d_nope, "mla: per-head dims without RoPE")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--d-rope", a.mla.d_rope, "mla: rotary dims (shared key part)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--d-v", a.mla.d_v, "mla: value dims per head")->check(CLI::PositiveNumber);
  cmd->add_option("--kv-rank", a.mla.kv_rank, "mla: latent width R")->check(CLI::PositiveNumber);
  cmd->add_option("--index-heads", a.index_heads, "dsa: indexer heads H_I")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--index-dim", a.index_dim, "dsa: indexer dim d_I")->check(CLI::PositiveNumber);
  cmd->add_option("--topk", a.topk, "dsa: keys per query")->check(CLI::PositiveNumber);
  cmd->add_option("--index-loss", a.index_loss, "dsa: sparse | dense");
}

namespace {

hp::bench::MLABenchOptions mla_options(const CPArgs& a) {
  HP_CHECK(a.attention == "mla" || a.attention == "dsa", "hp-bench cp: --attention '", a.attention,
           "' is not valid; valid: softmax, mla, dsa");
  for (const auto& flag : a.softmax_flags_given) {
    HP_CHECK(
        false, "hp-bench cp: ", flag, " does not apply to --attention ", a.attention,
        "; drop it (MLA takes --heads, --d-nope, --d-rope, --d-v, --kv-rank",
        a.attention == "dsa" ? ", DSA also --index-heads, --index-dim, --topk, --index-loss" : "",
        "; causal always)");
  }
  for (const auto& flag : a.dsa_flags_given) {
    HP_CHECK(a.attention == "dsa", "hp-bench cp: ", flag,
             " applies to --attention dsa only (got --attention ", a.attention, "); drop it");
  }
  if (a.nproc == 1) {  // the plain layer runs: no CP flag would do anything
    std::vector<std::string> given;
    if (a.algo_given) given.push_back("--cp-algo " + a.algo);
    if (a.schedule != "sync") given.push_back("--schedule " + a.schedule);
    if (a.bench.config.load_balance) given.push_back("--load-balance");
    hp::cp::check_nothing_given_without_cp("hp-bench cp --attention " + a.attention, given,
                                           "the plain layer runs");
  }
  hp::bench::MLABenchOptions o;
  o.seq = a.bench.seq;
  o.batch = a.bench.batch;
  o.shape = a.mla;
  o.shape.heads = a.bench.heads;
  if (a.algo_given) o.strategies = {a.algo};
  if (a.attention == "dsa") {
    HP_CHECK(!a.algo_given || a.algo == "all_gather", "hp-bench cp --attention dsa: --cp-algo '",
             a.algo, "' is not a DSA strategy; DSA runs the all_gather family");
    o.strategies = {"dsa", "latent_all_gather"};
    o.index_heads = a.index_heads;
    o.index_dim = a.index_dim;
    o.topk = a.topk;
    if (o.topk > o.seq) {  // DSA selects every visible key then; the JSON records what ran
      std::cerr << "hp-bench cp: --topk " << o.topk << " exceeds --seq " << o.seq << "; clamped to "
                << o.seq << " (every visible key is selected)" << std::endl;
      o.topk = o.seq;
    }
    o.index_loss = a.index_loss;
  }
  o.schedule = hp::cp::parse_schedule(a.schedule);
  o.load_balance = a.bench.config.load_balance;
  o.iters = a.bench.iters;
  return o;
}

nlohmann::json mla_json(const hp::bench::MLABenchOptions& o,
                        const std::vector<hp::bench::MLABenchResult>& results, int threads) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& r : results) {
    list.push_back({{"attention", r.strategy == "dsa" ? "dsa" : "mla"},
                    {"algorithm", r.strategy == "dsa" ? "all_gather" : r.strategy},
                    {"schedule", r.schedule},
                    {"cp", r.cp},
                    {"seq", o.seq},
                    {"batch", o.batch},
                    {"heads", o.shape.heads},
                    {"d_nope", o.shape.d_nope},
                    {"d_rope", o.shape.d_rope},
                    {"d_v", o.shape.d_v},
                    {"kv_rank", o.shape.kv_rank},
                    {"load_balance", o.load_balance},
                    {"threads_per_rank", threads},
                    {"step_time_s", r.step_time_s},
                    {"comm_bytes_per_rank", r.comm_bytes_per_rank},
                    {"comm_bytes_theory", r.comm_bytes_theory},
                    {"wire_bytes_per_rank", r.wire_bytes_per_rank},
                    {"link", hp::bench::emulated_link_rate().value_or("loopback")},
                    {"peak_rss_bytes", r.peak_rss_bytes}});
    if (r.strategy == "dsa") {
      list.back()["topk"] = o.topk;
      list.back()["index_heads"] = o.index_heads;
      list.back()["index_dim"] = o.index_dim;
      list.back()["index_loss"] = o.index_loss;
    }
  }
  return {{"results", list}};
}

}  // namespace

int run_mla_cp(const CPArgs& a, const std::vector<std::string>& argv) {
  const auto o = mla_options(a);
  hp::bench::check_mla_bench(o, a.nproc);  // before any process starts
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "cp --attention mla");
  auto world = join_world(env, a.timeout_s);
  const int threads = hp::common::threads_per_rank(world.local_size());
  const auto results = hp::bench::run_mla_bench(world, o);
  if (world.rank() != 0) return 0;
  if (a.json) {
    std::cout << mla_json(o, results, threads).dump() << std::endl;
    return 0;
  }
  for (const auto& r : results) {
    std::printf(
        "hp-bench cp --attention mla: %s %s cp=%lld S=%lld H=%lld dn=%lld dr=%lld dv=%lld "
        "R=%lld (%d thread(s) per rank)\n  step %.3f s (fwd+bwd, median, slowest rank); comm "
        "%lld bytes/rank (formula %lld)%s; peak RSS %.0f MiB (max rank, whole run)\n",
        r.strategy.c_str(), r.schedule.c_str(), (long long)r.cp, (long long)o.seq,
        (long long)o.shape.heads, (long long)o.shape.d_nope, (long long)o.shape.d_rope,
        (long long)o.shape.d_v, (long long)o.shape.kv_rank, threads, r.step_time_s,
        (long long)r.comm_bytes_per_rank, (long long)r.comm_bytes_theory,
        r.wire_bytes_per_rank >= 0
            ? hp::common::str_cat("; on the wire ", r.wire_bytes_per_rank, " bytes/rank (link ",
                                  hp::bench::emulated_link_rate().value_or("?"), ")")
                  .c_str()
            : "",
        r.peak_rss_bytes / 1048576.0);
  }
  return 0;
}

}  // namespace hp_bench
