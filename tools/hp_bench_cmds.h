// hp-bench's subcommands. Each has an options struct, an add_*_command that registers its CLI
// options (in help order) and a run_* that validates, runs and reports. comm and attention (and
// main) are in hp_bench.cpp; cp, hsdp, calibrate and report in hp_bench_layers.cpp; linear in
// hp_bench_linear.cpp; cp --attention mla in hp_bench_mla.cpp; moe in hp_bench_moe.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hp/bench/cp_bench.h"
#include "hp/bench/hsdp_bench.h"
#include "hp/bench/linear_bench.h"
#include "hp/bench/mla_bench.h"
#include "hp/bench/moe_bench.h"
#include "hp/bench/report.h"
#include "hp/comm/launch_env.h"
#include "hp/comm/types.h"
#include "hp/comm/world.h"

namespace CLI {
class App;
}

namespace hp_bench {

int launch_self(int nproc, const std::vector<std::string>& argv, const char* what);
// This process's rank of the job (launcher variables, or a world of one), its threads set;
// `trace`: the World records Chrome-trace events (comm, waits, attention calls).
hp::comm::World join_world(const std::optional<hp::comm::LaunchEnv>& env, double timeout_s,
                           bool trace = false);

// Checks those options' values together before anything runs: the query heads must be a
// multiple of the key/value heads. `cmd`: "attention" or "cp", for the message.
void check_shape(const char* cmd, int64_t heads, int64_t kv_heads);
// The attention shape options both `attention` and `cp` take.
void add_shape_options(CLI::App* cmd, int64_t& seq, int64_t& heads, int64_t& kv_heads,
                       int64_t& head_dim, int64_t& batch);

struct CPArgs {
  hp::bench::CPBenchOptions bench;
  int nproc = 2;
  std::string algo = "all_gather", schedule = "sync";
  int64_t degree = 0;
  bool json = false;
  double timeout_s = static_cast<double>(hp::comm::kDefaultTimeout.count());
  std::string trace;  // --trace: one Chrome-trace file of every rank's run (empty: none)
  // --attention mla (hp_bench_mla.cpp): the MLA dims; the softmax-only flags that were given
  // (refused with mla), and whether --cp-algo was (else both latent and expanded gathers run).
  std::string attention = "softmax";
  hp::attention::MLAShape mla;
  int64_t index_heads = 4, index_dim = 32, topk = 2048;  // dsa
  std::string index_loss = "sparse";
  std::vector<std::string> softmax_flags_given;
  std::vector<std::string> mla_flags_given, dsa_flags_given;  // refused where they do not apply
  std::vector<std::string> auto_flags_given;  // what --cp-algo auto chooses itself: refused
  bool algo_given = false;
};
CLI::App* add_cp_command(CLI::App& app, CPArgs& a);
int run_cp(CPArgs a, const std::vector<std::string>& argv);
void add_mla_options(CLI::App* cp_cmd, CPArgs& a);
int run_mla_cp(const CPArgs& a, const std::vector<std::string>& argv);

struct HsdpArgs {
  hp::bench::HsdpBenchOptions bench;
  int nproc = 2;
  std::string fusion = "off";
  bool json = false;
  double timeout_s = static_cast<double>(hp::comm::kDefaultTimeout.count());
};
CLI::App* add_hsdp_command(CLI::App& app, HsdpArgs& a);
int run_hsdp(HsdpArgs a, const std::vector<std::string>& argv);

struct LinearArgs {
  hp::bench::LinearBenchOptions bench;
  int nproc = 1;
  bool json = false;
  double timeout_s = static_cast<double>(hp::comm::kDefaultTimeout.count());
};
CLI::App* add_linear_command(CLI::App& app, LinearArgs& a);
int run_linear(const LinearArgs& a, const std::vector<std::string>& argv);

struct MoEArgs {
  hp::bench::MoEBenchOptions bench;
  int nproc = 2;
  bool json = false;
  double timeout_s = static_cast<double>(hp::comm::kDefaultTimeout.count());
};
CLI::App* add_moe_command(CLI::App& app, MoEArgs& a);
int run_moe(const MoEArgs& a, const std::vector<std::string>& argv);

CLI::App* add_calibrate_command(CLI::App& app, std::string& out);
int run_calibrate(const std::string& out, const std::string& child_flags);

CLI::App* add_report_command(CLI::App& app, hp::bench::ReportOptions& o);
int run_report_cmd(hp::bench::ReportOptions o);

}  // namespace hp_bench
