// hp-bench cp | hsdp | calibrate | report: each subcommand's options and its run.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/bench/calibrate.h"
#include "hp/bench/link.h"
#include "hp/comm/launch_env.h"
#include "hp/comm/launcher.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/strings.h"
#include "hp/common/threads.h"
#include "hp/common/trace.h"
#include "hp/cp/adapter.h"
#include "hp/cp/strategy.h"
#include "hp/plan/cost_model.h"
#include "hp_bench_cmds.h"

namespace hp_bench {

hp::comm::World join_world(const std::optional<hp::comm::LaunchEnv>& env, double timeout_s,
                           bool trace) {
  hp::comm::WorldOptions wo;
  wo.timeout = hp::comm::timeout_from_seconds(timeout_s);
  if (trace) wo.tracer = std::make_shared<hp::common::Tracer>();
  auto world = env ? hp::comm::World::from_launch_env(*env, wo)
                   : hp::comm::World::from_launch_env(hp::comm::LaunchEnv{}, wo);
  hp::common::configure_threads(hp::common::threads_per_rank(world.local_size()));
  return world;
}

CLI::App* add_cp_command(CLI::App& app, CPArgs& a) {
  auto* cmd = app.add_subcommand("cp", "one CP attention layer, forward + backward");
  add_shape_options(cmd, a.bench.seq, a.bench.heads, a.bench.kv_heads, a.bench.head_dim,
                    a.bench.batch);
  cmd->add_option("--cp,--nproc", a.nproc, "CP ranks (local processes)")->check(CLI::Range(1, 64));
  cmd->add_option("--cp-algo", a.algo,
                  hp::cp::StrategyRegistry::builtin().names_list(" | ") + " | auto");
  cmd->add_option("--ulysses-degree", a.degree,
                  "Ulysses degree (hybrid, usp: required; ulysses: the whole CP group)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--schedule", a.schedule, "sync | async");
  cmd->add_option("--adapter", a.bench.adapter,
                  hp::cp::AdapterRegistry::builtin().names_list(" | "));
  cmd->add_flag("--causal", a.bench.causal, "causal attention");
  cmd->add_flag("--projections", a.bench.projections,
                "Q/K/V/O projections around attention (what async overlaps)");
  cmd->add_flag("--load-balance", a.bench.config.load_balance,
                "head-tail load balance (all_gather, hybrid, ring, usp; data-order shards)");
  cmd->add_option("--ulysses-head-groups", a.bench.config.ulysses_head_groups,
                  "async ulysses, hybrid: Q/K/V and output all-to-alls (hybrid: and co-group K/V "
                  "gathers) per head group, pipelined with the groups' attention; usp: output "
                  "all-to-alls per group; all_gather: K/V gathers per group (0: auto)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--ulysses-row-parts", a.bench.config.ulysses_row_parts,
                  "async ulysses: the last head group's output all-to-all in this many row parts, "
                  "each sent while the next is attended (0: auto, 2 where each part keeps 2048 "
                  "rows)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag(
      "--always-local-first", a.bench.config.async_always_local_first,
      "async all_gather, hybrid: attend the local K/V chunks first even where the gather has "
      "landed (default: a part that starts after it runs as one call, as sync)");
  cmd->add_flag("--ring-keep-blocks", a.bench.config.ring_keep_blocks,
                "ring, usp: keep the K/V blocks from forward, so backward sends only the dK/dV "
                "accumulators (all_gather's bytes and memory)");
  cmd->add_option_function<std::string>(
      "--ring-backward",
      [&a](const std::string& v) { a.bench.config.ring_backward = hp::cp::parse_ring_backward(v); },
      "ring, usp: what the backward passes around the ring: blocks (the K/V blocks again with "
      "their dK/dV accumulators), queries ([q | dout] and the statistics with their dQ "
      "accumulators), or auto (the fewer bytes; default)");
  cmd->add_option_function<std::string>(
      "--kv-head-policy",
      [&a](const std::string& v) {
        a.bench.config.kv_head_policy = hp::cp::parse_kv_head_policy(v);
      },
      "ulysses, hybrid, usp with fewer K/V heads than the Ulysses degree: error (default) or "
      "repeat (each rank receives only the K/V head its query heads read); with all_gather "
      "or ring and --paired-with ulysses, the paired layer's");
  cmd->add_option("--paired-with", a.bench.paired_with,
                  "sync: time this algorithm's layer (all_gather | ulysses | ring) in alternation "
                  "with the one under test; its result comes first. contiguous (with "
                  "--load-balance, either schedule): the same layer on contiguous shards, so "
                  "the ratio is what head-tail balance buys");
  cmd->add_flag("--reference-step", a.bench.reference_step,
                "after each round of timed steps, time the reference step (blockwise attention "
                "fwd+bwd, causal, S=2048, H=8, D=64, on every rank at once): the machine's "
                "speed during the run");
  cmd->add_option("--documents", a.bench.documents,
                  "packed: N equal documents per sequence (attention stays inside each)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--iters", a.bench.iters, "timed steps")->check(CLI::Range(1, 1000));
  cmd->add_option("--timeout", a.timeout_s, "per-group timeout in seconds")->capture_default_str();
  cmd->add_flag("--json", a.json, "one JSON object on stdout");
  cmd->add_option("--trace", a.trace,
                  "write a Chrome trace of every rank's run (collectives, waits, attention "
                  "calls; warm-up and every variant included) to this file");
  add_mla_options(cmd, a);
  return cmd;
}

namespace {

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
  w.kv_head_policy = a.bench.config.kv_head_policy;
  w.ranks_on_node = a.nproc;
  auto ranked = hp::plan::rank_cp_configs(cal, a.nproc, w);
  if (log) {  // on stderr under --json, so stdout stays one JSON object
    FILE* to = a.json ? stderr : stdout;
    std::fprintf(to, "hp-bench cp: --cp-algo auto on link %s (calibration %s):\n", link.c_str(),
                 hp::plan::default_calibration_path(link).c_str());
    for (const auto& r : ranked)
      std::fprintf(to, "  %s\n", hp::plan::describe(r).c_str());
    std::fprintf(to, "  chosen: %s\n", ranked.front().name.c_str());
    std::fflush(to);
  }
  const auto& best = ranked.front().config;
  a.algo = hp::cp::to_string(best.algorithm);
  a.schedule = hp::cp::to_string(best.schedule);
  const bool grouped =
      best.algorithm == hp::cp::CPAlgorithm::kHybrid || best.algorithm == hp::cp::CPAlgorithm::kUsp;
  a.degree = grouped ? *best.ulysses_degree : 0;
  a.bench.config.load_balance = best.load_balance;
  a.bench.config.ring_keep_blocks = best.ring_keep_blocks;
  a.bench.config.kv_head_policy = best.kv_head_policy;  // the error policy where nothing repeats
}

// The CP configuration from the flags (auto: the cost model's choice), statically checked
// before any process starts.
void resolve_cp_config(CPArgs& a) {
  if (a.algo == "auto") {
    const std::string list = hp::common::str_join(a.auto_flags_given);
    HP_CHECK(list.empty(),
             "hp-bench cp: --cp-algo auto chooses the strategy, its schedule and "
             "its Ulysses degree with each strategy's defaults, so ",
             list, " would not run; drop ", a.auto_flags_given.size() == 1 ? "it" : "them",
             " or name the strategy with --cp-algo");
    choose_cp_config(a, !hp::comm::parse_launch_env(hp::comm::process_env()).has_value());
  }
  a.bench.config.algorithm = hp::cp::parse_algorithm(a.algo);
  a.bench.config.schedule = hp::cp::parse_schedule(a.schedule);
  // --kv-head-policy repeat beside --paired-with ulysses where this layer moves every K/V head
  // whole: the permission is the paired layer's, the only one that repeats.
  const auto moves_kv_whole = [](const hp::cp::CPAlgorithm& algo) {
    return algo.name() == hp::cp::CPAlgorithm::kAllGather ||
           algo.name() == hp::cp::CPAlgorithm::kRing;
  };
  if (a.bench.paired_with == "ulysses" && moves_kv_whole(a.bench.config.algorithm) &&
      a.bench.config.kv_head_policy == hp::cp::KVHeadPolicy::kRepeat) {
    a.bench.paired_kv_head_policy = hp::cp::KVHeadPolicy::kRepeat;
    a.bench.config.kv_head_policy = hp::cp::KVHeadPolicy::kError;
  }
  if (a.degree > 0) a.bench.config.ulysses_degree = a.degree;
  HP_CHECK(
      !a.bench.config.async_always_local_first ||
          ((a.bench.config.algorithm == "all_gather" || a.bench.config.algorithm == "hybrid") &&
           a.bench.config.schedule == hp::cp::CPSchedule::kAsync),
      "hp-bench cp: --always-local-first applies to --cp-algo all_gather or hybrid with "
      "--schedule async only (got ",
      a.algo, ", ", a.schedule, "); drop it or change those");
  check_shape("cp", a.bench.heads, a.bench.kv_heads);
  HP_CHECK(a.bench.documents >= 0 && a.bench.documents <= a.bench.seq, "hp-bench cp: --documents ",
           a.bench.documents, " must be in [0, --seq ", a.bench.seq,
           "] (equal documents of at least one token each)");
  if (a.nproc == 1) {  // one rank: the plain layer runs, no CP flag would do anything
    auto given = hp::cp::settings_given(a.bench.config);
    if (!a.bench.paired_with.empty()) given.push_back("--paired-with " + a.bench.paired_with);
    hp::cp::check_nothing_given_without_cp("hp-bench cp", given, "the plain layer runs");
  }
  if (auto normalized = hp::cp::normalize(a.bench.config, a.nproc)) {
    hp::cp::check_sequence(*normalized, a.nproc, a.bench.seq);
    hp::cp::check_heads(*normalized, a.nproc, a.bench.heads, a.bench.kv_heads);
    hp::bench::paired_config(a.bench, *normalized, a.nproc);
  }
}

nlohmann::json cp_results_json(const CPArgs& a,
                               const std::vector<hp::bench::CPBenchResult>& results, int threads) {
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
                    {"load_balance", r.load_balance},
                    {"documents", a.bench.documents},
                    {"ulysses_head_groups", r.ulysses_head_groups},
                    {"ulysses_row_parts", r.ulysses_row_parts},
                    {"always_local_first", r.always_local_first},
                    {"ring_keep_blocks", r.ring_keep_blocks},
                    {"ring_backward", hp::cp::to_string(r.ring_backward)},
                    {"kv_head_policy", hp::cp::to_string(r.kv_head_policy)},
                    {"visible_tile_fraction",
                     hp::bench::visible_tile_fraction(r.seq, a.bench.causal, a.bench.documents)},
                    {"threads_per_rank", threads},
                    {"step_time_s", r.step_time_s},
                    {"comm_bytes_per_rank", r.comm_bytes_per_rank},
                    {"comm_bytes_theory", r.comm_bytes_theory},
                    {"comm_bytes_by_rank", r.comm_bytes_by_rank},
                    {"comm_bytes_theory_by_rank", r.comm_bytes_theory_by_rank},
                    {"wire_bytes_per_rank", r.wire_bytes_per_rank},
                    {"link", hp::bench::emulated_link_rate().value_or("loopback")},
                    {"peak_rss_bytes", r.peak_rss_bytes},
                    {"peak_rss_per_rank", r.peak_rss_per_rank},
                    {"step_peak_bytes", r.step_peak_bytes},
                    {"step_peak_per_rank", r.step_peak_per_rank},
                    {"step_tensor_peak_bytes", r.step_tensor_peak_bytes},
                    {"step_tensor_peak_per_rank", r.step_tensor_peak_per_rank},
                    {"fresh_host_bytes_per_step", r.fresh_host_bytes_per_step},
                    {"per_rank_attention_cpu_s", r.attention_cpu_s_per_rank},
                    {"exposed_comm_s", r.exposed_comm_s},
                    {"overlap_fraction", r.overlap_fraction},
                    {"step_time_without_documents_s", r.step_time_without_documents_s},
                    {"documents_speedup", r.documents_speedup},
                    {"async_speedup", r.async_speedup},
                    {"paired_with", a.bench.paired_with},
                    {"paired_speedup", r.paired_speedup},
                    {"reference_step_s", r.reference_step_s}});
  }
  return {{"results", list}};
}

void print_cp(const CPArgs& a, const std::vector<hp::bench::CPBenchResult>& results, int threads) {
  for (const auto& r : results) {
    std::printf(
        "hp-bench cp: %s %s cp=%lld U=%lld S=%lld H=%lld Hkv=%lld D=%lld causal=%s%s "
        "(%d thread(s) per rank)\n  step %.3f s (median, slowest rank); comm %lld "
        "bytes on the busiest rank (formula %lld); peak RSS %.0f MiB, a step's own peak %.0f MiB, "
        "its "
        "tensors' peak %.0f MiB (max rank)%s\n  exposed comm "
        "%.3f s/step%s%s\n",
        (r.algorithm + (r.ring_keep_blocks ? "(kept)" : "")).c_str(), r.schedule.c_str(),
        (long long)r.cp, (long long)r.ulysses_degree, (long long)r.seq, (long long)a.bench.heads,
        (long long)a.bench.kv_heads, (long long)a.bench.head_dim, a.bench.causal ? "yes" : "no",
        a.bench.projections ? " +projections" : "", threads, r.step_time_s,
        (long long)r.comm_bytes_per_rank, (long long)r.comm_bytes_theory,
        r.peak_rss_bytes / 1048576.0, r.step_peak_bytes / 1048576.0,
        r.step_tensor_peak_bytes / 1048576.0,
        r.fresh_host_bytes_per_step >= 0
            ? hp::common::str_cat("; fresh host pages ",
                                  hp::common::str_cat(r.fresh_host_bytes_per_step / 1048576.0),
                                  " MiB/step")
                  .c_str()
            : "",
        r.exposed_comm_s,
        r.schedule == "async"
            ? hp::common::str_cat(" (overlap fraction ", r.overlap_fraction,
                                  "; sync step / async step, paired steps in this run: ",
                                  r.async_speedup, "x median)")
                  .c_str()
            : "",
        r.wire_bytes_per_rank >= 0
            ? hp::common::str_cat("; on the wire ", r.wire_bytes_per_rank,
                                  " bytes/rank, mean (link ",
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
    if (r.reference_step_s > 0) {
      std::printf("  reference step %.3f s (median, slowest rank)\n", r.reference_step_s);
    }
    if (r.paired_speedup > 0) {
      std::printf("  %s step / this step, paired steps in this run: %.3fx (median)\n",
                  a.bench.paired_with.c_str(), r.paired_speedup);
    }
    if (a.bench.documents > 0) {
      const double with =
          hp::bench::visible_tile_fraction(r.seq, a.bench.causal, a.bench.documents);
      const double without = hp::bench::visible_tile_fraction(r.seq, a.bench.causal, 0);
      std::printf(
          "  %lld packed documents: %.4f of the 256x256 score tiles visible, %.4f "
          "without documents (ratio %.2f)\n",
          (long long)a.bench.documents, with, without, without / with);
      std::printf(
          "  the same batch without documents, paired steps in this run: step %.3f s (median); "
          "speed-up %.2fx (median of the per-step ratios)\n",
          r.step_time_without_documents_s, r.documents_speedup);
    }
  }
}

}  // namespace

int run_cp(CPArgs a, const std::vector<std::string>& argv) {
  if (a.attention != "softmax") return run_mla_cp(a, argv);
  std::vector<std::string> not_softmax = a.mla_flags_given;
  not_softmax.insert(not_softmax.end(), a.dsa_flags_given.begin(), a.dsa_flags_given.end());
  for (const auto& flag : not_softmax) {
    HP_CHECK(false, "hp-bench cp: ", flag,
             " applies to --attention mla or dsa, not to softmax "
             "attention (the default); drop it or add --attention mla|dsa");
  }
  resolve_cp_config(a);
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "cp");
  auto world = join_world(env, a.timeout_s, !a.trace.empty());
  auto results = hp::bench::run_cp_bench(world, a.bench);
  if (!a.trace.empty()) hp::comm::write_world_trace(world, a.trace);
  if (world.rank() != 0) return 0;
  const int threads = hp::common::threads_per_rank(world.local_size());
  if (a.json) {
    std::cout << cp_results_json(a, results, threads).dump() << std::endl;
    return 0;
  }
  print_cp(a, results, threads);
  return 0;
}

CLI::App* add_hsdp_command(CLI::App& app, HsdpArgs& a) {
  auto* cmd = app.add_subcommand("hsdp", "decoder stack backward: HSDP pipeline vs baseline");
  cmd->add_option("--nproc", a.nproc, "local rank processes")->check(CLI::Range(1, 64));
  a.bench.dp_shard = 0;  // not given: --nproc / --dp-replicate
  cmd->add_option("--dp-shard", a.bench.dp_shard, "shard degree Sd (default --nproc / R)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--dp-replicate", a.bench.dp_replicate, "replicas R")->check(CLI::PositiveNumber);
  cmd->add_option("--comm-fusion", a.fusion, "on | off");
  cmd->add_option("--layers", a.bench.layers, "decoder layers")->check(CLI::PositiveNumber);
  cmd->add_option("--hidden", a.bench.hidden, "hidden size")->check(CLI::PositiveNumber);
  cmd->add_option("--ffn", a.bench.ffn, "MLP width")->check(CLI::PositiveNumber);
  cmd->add_option("--seq", a.bench.seq, "tokens per rank")->check(CLI::PositiveNumber);
  cmd->add_option("--iters", a.bench.iters, "timed steps")->check(CLI::Range(1, 1000));
  cmd->add_option("--timeout", a.timeout_s, "per-group timeout in seconds")->capture_default_str();
  cmd->add_flag("--json", a.json, "one JSON object on stdout");
  return cmd;
}

namespace {

nlohmann::json hsdp_json(const HsdpArgs& a, const std::vector<hp::bench::HsdpBenchResult>& results,
                         int threads, double speedup) {
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
                    {"wire_bytes_per_rank", r.wire_bytes_per_rank},
                    {"param_bytes_per_rank", r.param_bytes_per_rank},
                    {"full_param_bytes", r.full_param_bytes}});
  }
  return {{"nproc", a.nproc},
          {"dp_shard", b.dp_shard},
          {"dp_replicate", b.dp_replicate},
          {"comm_fusion", a.fusion},
          {"threads_per_rank", threads},
          {"model", {{"layers", b.layers}, {"hidden", b.hidden}, {"ffn", b.ffn}, {"seq", b.seq}}},
          {"results", list},
          {"backward_speedup", speedup}};
}

void print_hsdp(const HsdpArgs& a, const std::vector<hp::bench::HsdpBenchResult>& results,
                int threads, double speedup) {
  const auto& b = a.bench;
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
    if (r.wire_bytes_per_rank >= 0) {
      std::printf("%-10s on the wire: %lld bytes/rank per step (counted: %lld)\n", "",
                  (long long)r.wire_bytes_per_rank,
                  (long long)(r.bytes_all_gather + r.bytes_reduce_scatter + r.bytes_all_reduce));
    }
  }
  std::printf("parameters per rank: %.2f MiB of %.2f MiB (1/%.2f); backward speedup %.2fx\n",
              results[1].param_bytes_per_rank / 1048576.0, results[1].full_param_bytes / 1048576.0,
              static_cast<double>(results[1].full_param_bytes) /
                  static_cast<double>(std::max<int64_t>(1, results[1].param_bytes_per_rank)),
              speedup);
}

}  // namespace

int run_hsdp(HsdpArgs a, const std::vector<std::string>& argv) {
  HP_CHECK(a.fusion == "on" || a.fusion == "off", "hp-bench hsdp: --comm-fusion '", a.fusion,
           "' is not valid; valid: on, off");
  a.bench.comm_fusion = a.fusion == "on";
  if (a.bench.dp_shard == 0) {
    HP_CHECK(a.nproc % a.bench.dp_replicate == 0, "hp-bench hsdp: --dp-replicate ",
             a.bench.dp_replicate, " does not divide --nproc ", a.nproc,
             "; give --dp-shard, or a --dp-replicate that divides --nproc");
    a.bench.dp_shard = a.nproc / a.bench.dp_replicate;
  }
  HP_CHECK(a.bench.dp_shard * a.bench.dp_replicate == a.nproc, "hp-bench hsdp: --dp-shard ",
           a.bench.dp_shard, " x --dp-replicate ", a.bench.dp_replicate, " = ",
           a.bench.dp_shard * a.bench.dp_replicate, " but --nproc is ", a.nproc,
           "; make the product equal --nproc");
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "hsdp");
  auto world = join_world(env, a.timeout_s);
  const int threads = hp::common::threads_per_rank(world.local_size());
  auto results = hp::bench::run_hsdp_bench(world, a.bench);
  if (world.rank() != 0) return 0;
  const double speedup =
      results[1].backward_s > 0 ? results[0].backward_s / results[1].backward_s : 0.0;
  if (a.json) {
    std::cout << hsdp_json(a, results, threads, speedup).dump() << std::endl;
    return 0;
  }
  print_hsdp(a, results, threads, speedup);
  return 0;
}

CLI::App* add_calibrate_command(CLI::App& app, std::string& out) {
  auto* cmd =
      app.add_subcommand("calibrate", "measure the CP cost model's inputs for this link; cache");
  cmd->add_option("--out", out, "also write the calibration here");
  return cmd;
}

int run_calibrate(const std::string& out, const std::string& child_flags) {
  hp::bench::CalibrateOptions o;
  o.self_exe = hp::comm::self_executable();
  o.child_flags = child_flags;
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

CLI::App* add_report_command(CLI::App& app, hp::bench::ReportOptions& o) {
  auto* cmd = app.add_subcommand("report", "the benchmark report (docs/benchmarks/)");
  cmd->add_option("--link-rate", o.links,
                  "links to report on (e.g. 1gbit; 'loopback' for plain loopback); the first "
                  "is the main one; default loopback");
  cmd->add_option("--out", o.out_dir, "output directory");
  cmd->add_flag("--recalibrate", o.recalibrate, "redo the cached calibrations");
  cmd->add_option("--seqs", o.seqs, "sequence lengths of the grid");
  cmd->add_option("--ranks", o.ranks, "CP sizes of the grid");
  cmd->add_option("--iters", o.iters_small, "timed steps per CP run below S=16384");
  return cmd;
}

int run_report_cmd(hp::bench::ReportOptions o) {
  o.self_exe = hp::comm::self_executable();
  const auto sibling = std::filesystem::path(o.self_exe).parent_path() / "hp-train";
  if (std::filesystem::exists(sibling)) o.train_exe = sibling.string();
  if (o.links.empty()) o.links = {"loopback"};
  for (const auto& l : o.links) {
    if (l != "loopback") hp::bench::parse_link_rate(l);  // fail before anything runs
  }
  const auto path = hp::bench::run_report(o);
  std::printf("hp-bench report: %s, results.md, chart.svg%s\n", path.c_str(),
              o.train_exe.empty() ? "" : ", timeline.svg");
  return 0;
}

}  // namespace hp_bench
