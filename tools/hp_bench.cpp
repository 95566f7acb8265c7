// hp-bench: measurements, never pass/fail tests.
//   hp-bench comm --nproc N [--bytes B] [--iters K] [--json]
//   hp-bench attention --seq S --heads H --kv-heads HK --head-dim D [--causal] [--batch B]
//                      [--primitive math|blockwise|sdpa|all] [--iters K] [--json]
//   hp-bench cp --seq S --heads H --kv-heads HK --head-dim D --cp P --cp-algo A
//               [--ulysses-degree U] [--schedule sync|async] [--causal] [--iters K] [--json]
//   hp-bench cp --attention mla --seq S --heads H --cp P [--cp-algo latent_all_gather|ulysses|
//               all_gather] [--d-nope --d-rope --d-v --kv-rank] [--schedule] [--load-balance]
//   hp-bench moe [--experts E --top-k K --ep P --tokens T --hidden H --expert-ffn F]
//   hp-bench calibrate [--link-rate RATE] [--out FILE]
//   hp-bench report [--link-rate RATE ...] [--out docs/benchmarks] [--recalibrate]
//   hp-bench linear --mixer gdn|kda --seq S --heads H --head-dim K [--value-dim V]
//                   [--value-heads HV] [--batch B] [--cp P --cp-mode ulysses|state_passing
//                   --state-exchange all_gather|p2p] [--kernel chunked|recurrent] [--json]
//   hp-bench hsdp --nproc N --dp-shard Sd --dp-replicate R [--comm-fusion on|off]
//                 [--layers L --hidden H --ffn F --seq S] [--iters K] [--json]
// comm, cp, hsdp and moe take --link-rate RATE: all ranks run in a network namespace whose loopback
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
#include "hp/comm/launcher.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/host_allocator.h"
#include "hp/common/threads.h"
#include "hp/common/trace.h"
#include "hp/cp/adapter.h"
#include "hp/cp/config.h"
#include "hp/cp/strategy.h"
#include "hp/plan/cost_model.h"
#include "hp_bench_cmds.h"

namespace hp_bench {

int launch_self(int nproc, const std::vector<std::string>& argv, const char* what) {
  return hp::comm::relaunch_as_local_ranks(nproc, argv, std::string("hp-bench ") + what);
}

void check_shape(const char* cmd, int64_t heads, int64_t kv_heads) {
  HP_CHECK(heads % kv_heads == 0, "hp-bench ", cmd, ": --heads ", heads,
           " is not a multiple of --kv-heads ", kv_heads,
           " (each key/value head serves a whole group of query heads); give --kv-heads a "
           "divisor of --heads (the default is 8)");
}

void add_shape_options(CLI::App* cmd, int64_t& seq, int64_t& heads, int64_t& kv_heads,
                       int64_t& head_dim, int64_t& batch) {
  cmd->add_option("--seq", seq, "sequence length S (global)")->check(CLI::PositiveNumber);
  cmd->add_option("--heads", heads, "query heads H")->check(CLI::PositiveNumber);
  cmd->add_option("--kv-heads", kv_heads, "key/value heads")->check(CLI::PositiveNumber);
  cmd->add_option("--head-dim", head_dim, "head dim D")->check(CLI::PositiveNumber);
  cmd->add_option("--batch", batch, "batch B")->check(CLI::PositiveNumber);
}

}  // namespace hp_bench

using namespace hp_bench;

namespace {

struct CommArgs {
  int nproc = 1;
  hp::bench::CommBenchOptions bench;
  bool json = false;
  double timeout_s = static_cast<double>(hp::comm::kDefaultTimeout.count());
  std::string trace;  // Chrome-trace file, one track per rank
};

CLI::App* add_comm_command(CLI::App& app, CommArgs& a) {
  auto* c = app.add_subcommand("comm", "collective volume and throughput over local ranks");
  c->add_option("--nproc", a.nproc, "local rank processes to spawn")->check(CLI::Range(1, 64));
  c->add_option("--bytes", a.bench.bytes, "input bytes per rank")->check(CLI::PositiveNumber);
  c->add_option("--iters", a.bench.iters, "timed iterations")->check(CLI::Range(1, 100000));
  c->add_option("--timeout", a.timeout_s, "per-group timeout in seconds")->capture_default_str();
  c->add_flag("--json", a.json, "one JSON object on stdout");
  c->add_option("--trace", a.trace, "write a Chrome trace (one track per rank) to this file");
  return c;
}

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
  hp::comm::WorldOptions wo;
  wo.timeout = hp::comm::timeout_from_seconds(a.timeout_s);
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) return launch_self(a.nproc, argv, "comm");
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
  bool child = false;       // internal: run one primitive and print its result as JSON
  std::string child_flags;  // appended to each child's command (the tool's --host-allocator)
};

CLI::App* add_attention_command(CLI::App& app, AttentionArgs& a) {
  auto* cmd = app.add_subcommand("attention", "one attention layer, fwd and fwd+bwd");
  add_shape_options(cmd, a.bench.seq, a.bench.heads, a.bench.kv_heads, a.bench.head_dim,
                    a.bench.batch);
  cmd->add_flag("--causal", a.bench.causal, "causal mask");
  cmd->add_option("--primitive", a.primitive, "math | blockwise | sdpa | all");
  cmd->add_option("--iters", a.bench.iters, "timed iterations")->check(CLI::Range(1, 1000));
  cmd->add_option("--block-q", a.bench.block_q, "blockwise: query rows per tile (0: default)");
  cmd->add_option("--block-kv", a.bench.block_kv, "blockwise: key rows per tile (0: default)");
  cmd->add_flag("--json", a.json, "one JSON object on stdout");
  cmd->add_flag("--child", a.child, "internal")->group("");
  return cmd;
}

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
      hp::comm::self_executable(), " attention --child --primitive ", primitive, " --seq ", b.seq,
      " --heads ", b.heads, " --kv-heads ", b.kv_heads, " --head-dim ", b.head_dim, " --batch ",
      b.batch, " --iters ", b.iters, " --block-q ", b.block_q, " --block-kv ", b.block_kv,
      b.causal ? " --causal" : "", a.child_flags);
  return nlohmann::json::parse(hp::bench::run_for_json(cmd));
}

// The primitives --primitive names ("all": every registered one).
std::vector<std::string> attention_primitives(const std::string& primitive) {
  if (primitive == "all") return hp::attention::AttentionRegistry::builtin().names();
  hp::attention::AttentionRegistry::builtin().get(primitive);  // clear error if unknown
  return {primitive};
}

// Every primitive measured in its own process; math is skipped (or refused, when asked for by
// name) where its [B, H, S, S] scores would not fit in memory.
nlohmann::json measure_attention(const AttentionArgs& a) {
  const auto& b = a.bench;
  const auto prims = attention_primitives(a.primitive);
  const double gflops = hp::bench::measure_matmul_gflops();
  const double tile_gflops = hp::attention::blockwise_tile_gemm_gflops();
  nlohmann::json out = {{"seq", b.seq},
                        {"heads", b.heads},
                        {"kv_heads", b.kv_heads},
                        {"head_dim", b.head_dim},
                        {"batch", b.batch},
                        {"causal", b.causal},
                        {"matmul_gflops", gflops},
                        {"tile_gemm", hp::attention::blockwise_tile_gemm_path()},
                        {"tile_gemm_gflops", tile_gflops},
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
  return out;
}

void print_attention(const AttentionArgs& a, const nlohmann::json& out) {
  const auto& b = a.bench;
  const double gflops = out["matmul_gflops"].get<double>();
  const double tile_gflops = out["tile_gemm_gflops"].get<double>();
  std::printf(
      "hp-bench attention: B=%lld H=%lld Hkv=%lld D=%lld S=%lld causal=%s; "
      "fp32 matmul roofline %.1f GFLOP/s (2048^3, this run); blockwise tile GEMM (%s) %.1f "
      "GFLOP/s ([256 x 64] x [64 x 256])\n",
      (long long)b.batch, (long long)b.heads, (long long)b.kv_heads, (long long)b.head_dim,
      (long long)b.seq, b.causal ? "yes" : "no", gflops,
      out["tile_gemm"].get<std::string>().c_str(), tile_gflops);
  std::printf("%-10s %10s %12s %11s %15s %9s %9s %12s\n", "primitive", "fwd_s", "fwd_bwd_s",
              "fwd_GF/s", "fwd_bwd_GF/s", "%roof", "%tile", "peak_MiB");
  for (const auto& r : out["results"]) {
    std::printf("%-10s %10.3f %12.3f %11.1f %15.1f %8.1f%% %8.1f%% %12.1f\n",
                r["primitive"].get<std::string>().c_str(), r["fwd_s"].get<double>(),
                r["fwd_bwd_s"].get<double>(), r["fwd_gflops"].get<double>(),
                r["fwd_bwd_gflops"].get<double>(),
                100.0 * r["fwd_bwd_gflops"].get<double>() / gflops,
                100.0 * r["fwd_bwd_gflops"].get<double>() / tile_gflops,
                r["peak_rss_bytes"].get<int64_t>() / 1048576.0);
  }
  for (const auto& s : out["skipped"]) {
    std::printf("%-10s skipped: %s\n", s["primitive"].get<std::string>().c_str(),
                s["reason"].get<std::string>().c_str());
  }
}

int run_attention(const AttentionArgs& a) {
  if (a.child) {
    hp::common::configure_threads(hp::common::available_cores());
    auto j = to_json(hp::bench::run_attention_bench(a.bench, a.primitive));
    // The allocator this child measured under (the parent's --host-allocator).
    j["host_allocator"] = hp::common::installed_host_cache() != nullptr ? "caching" : "system";
    std::cout << j.dump() << std::endl;
    return 0;
  }
  check_shape("attention", a.bench.heads, a.bench.kv_heads);
  // The rooflines are measured here with the threads each child runs its primitive on.
  hp::common::configure_threads(hp::common::available_cores());
  const auto out = measure_attention(a);
  if (a.json) {
    std::cout << out.dump() << std::endl;
    return 0;
  }
  print_attention(a, out);
  return 0;
}

// Every subcommand's options (bound by CLI11, so this object stays put) and its CLI::App.
struct Commands {
  CommArgs comm;
  AttentionArgs attention;
  CPArgs cp;
  HsdpArgs hsdp;
  LinearArgs linear;
  MoEArgs moe;
  std::string calibrate_out;
  hp::bench::ReportOptions report;
  std::string link_rate;  // comm, cp, hsdp, calibrate
  std::string host_allocator = "caching";
  CLI::App *comm_cmd = nullptr, *attention_cmd = nullptr, *cp_cmd = nullptr, *hsdp_cmd = nullptr,
           *linear_cmd = nullptr, *moe_cmd = nullptr, *calibrate_cmd = nullptr,
           *report_cmd = nullptr;
};

void add_commands(CLI::App& app, Commands& c) {
  app.require_subcommand(1);
  c.comm_cmd = add_comm_command(app, c.comm);
  c.attention_cmd = add_attention_command(app, c.attention);
  c.cp_cmd = add_cp_command(app, c.cp);
  c.hsdp_cmd = add_hsdp_command(app, c.hsdp);
  c.linear_cmd = add_linear_command(app, c.linear);
  c.moe_cmd = add_moe_command(app, c.moe);
  c.calibrate_cmd = add_calibrate_command(app, c.calibrate_out);
  c.report_cmd = add_report_command(app, c.report);
  for (auto* cmd : {c.comm_cmd, c.cp_cmd, c.hsdp_cmd, c.moe_cmd, c.calibrate_cmd}) {
    cmd->add_option("--link-rate", c.link_rate,
                    "emulate a link of this rate (e.g. 1gbit) on a namespaced loopback; root");
  }
  for (auto* cmd : {c.comm_cmd, c.attention_cmd, c.cp_cmd, c.hsdp_cmd, c.linear_cmd, c.moe_cmd,
                    c.calibrate_cmd, c.report_cmd}) {
    cmd->add_option("--host-allocator", c.host_allocator, hp::common::kHostAllocatorHelp)
        ->check(CLI::IsMember(hp::common::host_allocator_choices()));
  }
}

// Under an external launcher (torchrun, mpirun, mpiexec, Slurm; also the ranks --nproc
// spawned) the job's size is its world size: a subcommand's --nproc, when given, must agree, and
// otherwise takes it (the checks made before any rank starts size the run by --nproc).
void take_launcher_size(Commands& c) {
  const auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env) return;
  const std::pair<CLI::App*, int*> sized[] = {{c.comm_cmd, &c.comm.nproc},
                                              {c.cp_cmd, &c.cp.nproc},
                                              {c.hsdp_cmd, &c.hsdp.nproc},
                                              {c.linear_cmd, &c.linear.nproc},
                                              {c.moe_cmd, &c.moe.nproc}};
  for (const auto& [cmd, nproc] : sized) {
    if (!cmd->parsed()) continue;
    const char* flag = cmd == c.cp_cmd ? "--cp" : "--nproc";
    HP_CHECK(cmd->count(flag) == 0 || *nproc == env->world_size, "hp-bench ", cmd->get_name(), ": ",
             flag, " ", *nproc, " spawns local ranks, but this process was started by ",
             env->launcher, " with a world of ", env->world_size, " ranks; drop ", flag,
             " (the launcher starts the ranks) or make it ", env->world_size);
    *nproc = env->world_size;
  }
}

// The parsed subcommand (under an emulated link first when --link-rate asks for one).
int run_command(const Commands& c, const std::vector<std::string>& args) {
  // --timeout is checked before anything starts (an emulated link, local ranks).
  if (c.comm_cmd->parsed()) hp::comm::timeout_from_seconds(c.comm.timeout_s);
  if (c.cp_cmd->parsed()) hp::comm::timeout_from_seconds(c.cp.timeout_s);
  if (c.hsdp_cmd->parsed()) hp::comm::timeout_from_seconds(c.hsdp.timeout_s);
  if (c.linear_cmd->parsed()) hp::comm::timeout_from_seconds(c.linear.timeout_s);
  if (c.moe_cmd->parsed()) hp::comm::timeout_from_seconds(c.moe.timeout_s);
  if (!c.link_rate.empty() && !hp::bench::emulated_link_rate()) {
    return hp::bench::run_in_emulated_link(c.link_rate, args);
  }
  if (c.hsdp_cmd->parsed()) return run_hsdp(c.hsdp, args);
  // The children that calibrate, report and attention measure with run under this choice too.
  const std::string child_flags = hp::common::host_allocator_flag(c.host_allocator);
  if (c.calibrate_cmd->parsed()) return run_calibrate(c.calibrate_out, child_flags);
  if (c.report_cmd->parsed()) {
    auto report = c.report;
    report.child_flags = child_flags;
    return run_report_cmd(report);
  }
  if (c.cp_cmd->parsed()) {
    auto cp = c.cp;
    cp.algo_given = c.cp_cmd->count("--cp-algo") > 0;
    for (const char* flag :
         {"--kv-heads", "--head-dim", "--ulysses-degree", "--adapter", "--causal", "--projections",
          "--documents", "--ulysses-head-groups", "--always-local-first", "--paired-with",
          "--ring-keep-blocks", "--ulysses-row-parts", "--ring-backward", "--reference-step",
          "--trace", "--kv-head-policy"}) {
      if (c.cp_cmd->count(flag) > 0) cp.softmax_flags_given.push_back(flag);
    }
    auto given = [&](std::initializer_list<const char*> flags, std::vector<std::string>& out) {
      for (const char* flag : flags) {
        if (c.cp_cmd->count(flag) > 0) out.push_back(flag);
      }
    };
    given({"--d-nope", "--d-rope", "--d-v", "--kv-rank"}, cp.mla_flags_given);
    given({"--index-heads", "--index-dim", "--topk", "--index-loss"}, cp.dsa_flags_given);
    given({"--schedule", "--ulysses-degree", "--ring-keep-blocks", "--ulysses-head-groups",
           "--ulysses-row-parts", "--always-local-first", "--ring-backward"},
          cp.auto_flags_given);
    return run_cp(cp, args);
  }
  if (c.linear_cmd->parsed()) {
    HP_CHECK(c.linear_cmd->count("--chunk-size") == 0 || c.linear.bench.kernel != "recurrent",
             "hp-bench linear: --chunk-size sizes the chunked kernel's chunks; --kernel recurrent "
             "runs token by token, so drop it or use --kernel chunked");
    if (c.linear.nproc == 1) {
      std::vector<std::string> given;
      if (c.linear_cmd->count("--cp-mode") > 0) given.push_back("--cp-mode " + c.linear.bench.mode);
      if (c.linear_cmd->count("--state-exchange") > 0)
        given.push_back("--state-exchange " + c.linear.bench.state_exchange);
      hp::cp::check_nothing_given_without_cp("hp-bench linear", given, "the plain mixer runs");
    }
    return run_linear(c.linear, args);
  }
  if (c.moe_cmd->parsed()) return run_moe(c.moe, args);
  if (c.comm_cmd->parsed()) return run_comm(c.comm, args);
  if (c.attention_cmd->parsed()) {
    for (const char* flag : {"--block-q", "--block-kv"}) {
      HP_CHECK(c.attention.child || c.attention_cmd->count(flag) == 0 ||
                   c.attention.primitive == "blockwise" || c.attention.primitive == "all",
               "hp-bench attention: ", flag, " sizes the blockwise primitive's tiles; --primitive ",
               c.attention.primitive, " has none, so drop it or use --primitive blockwise");
    }
    auto attention = c.attention;
    attention.child_flags = child_flags;
    return run_attention(attention);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv, argv + argc);
  CLI::App app{"hp-bench: hyperparallel benchmarks (medians; compare ratios from one run)"};
  Commands commands;
  add_commands(app, commands);
  CLI11_PARSE(app, argc, argv);
  try {
    hp::common::apply_host_allocator_choice(commands.host_allocator);
    take_launcher_size(commands);
    return run_command(commands, args);
  } catch (const std::exception& e) {
    std::cerr << "hp-bench: " << e.what() << std::endl;
    hp::comm::report_rank_error(e);
    return 1;
  }
}
