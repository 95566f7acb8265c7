// hp-bench: measurements, never pass/fail tests.
//   hp-bench comm --nproc N [--bytes B] [--iters K] [--json]
// With --nproc N (N > 1) it spawns N local rank processes of itself; under torchrun / mpirun /
// Slurm variables it is one rank of that job.
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/bench/comm_bench.h"
#include "hp/comm/launch_env.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "hp/train/launcher.h"

namespace {

struct CommArgs {
  int nproc = 1;
  hp::bench::CommBenchOptions bench;
  bool json = false;
  double timeout_s = 300;
};

void print_comm(const std::vector<hp::bench::CommBenchResult>& results, int nproc, bool json) {
  if (json) {
    nlohmann::json out = {{"nproc", nproc}, {"results", nlohmann::json::array()}};
    for (const auto& r : results) {
      out["results"].push_back({{"op", r.op},
                                {"bytes_in", r.bytes_in},
                                {"bytes_sent_per_rank", r.bytes_sent_per_rank},
                                {"theory_bytes_per_rank", r.theory_bytes_per_rank},
                                {"median_s", r.median_s},
                                {"gbps", r.gbps}});
    }
    std::cout << out.dump() << std::endl;
    return;
  }
  std::printf("hp-bench comm: %d ranks, median of the slowest rank\n", nproc);
  std::printf("%-15s %14s %20s %22s %10s %8s\n", "op", "bytes_in", "bytes_sent_per_rank",
              "theory_bytes_per_rank", "median_ms", "GB/s");
  for (const auto& r : results) {
    std::printf("%-15s %14lld %20lld %22lld %10.2f %8.2f\n", r.op.c_str(),
                static_cast<long long>(r.bytes_in), static_cast<long long>(r.bytes_sent_per_rank),
                static_cast<long long>(r.theory_bytes_per_rank), r.median_s * 1e3, r.gbps);
  }
  std::fflush(stdout);
}

int run_comm(const CommArgs& a, const std::vector<std::string>& argv) {
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (!env && a.nproc > 1) {
    hp::train::LaunchOptions lo;
    lo.nproc = a.nproc;
    lo.argv = argv;
    lo.argv[0] = hp::train::self_executable();
    auto res = hp::train::launch_local_ranks(lo);
    if (res.exit_code != 0) std::cerr << "hp-bench comm: " << res.message << std::endl;
    return res.exit_code;
  }
  hp::comm::WorldOptions wo;
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  hp::comm::World world = env ? hp::comm::World::from_launch_env(*env, wo)
                              : hp::comm::World::from_launch_env(hp::comm::LaunchEnv{}, wo);
  hp::common::configure_threads(hp::common::threads_per_rank(world.local_size()));
  auto results = hp::bench::run_comm_bench(world, a.bench);
  if (world.rank() == 0) print_comm(results, world.size(), a.json);
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
  CLI11_PARSE(app, argc, argv);
  try {
    if (c->parsed()) return run_comm(comm, args);
  } catch (const std::exception& e) {
    std::cerr << "hp-bench: " << e.what() << std::endl;
    hp::train::report_rank_error(e.what());
    return 1;
  }
  return 0;
}
