// hp-bench's subcommands over the parallel layers (cp, hsdp, calibrate, report); main and the
// comm/attention subcommands are in hp_bench.cpp.
#pragma once

#include <string>
#include <vector>

#include "hp/bench/cp_bench.h"
#include "hp/bench/hsdp_bench.h"
#include "hp/bench/report.h"

namespace hp_bench {

int launch_self(int nproc, const std::vector<std::string>& argv, const char* what);

struct CPArgs {
  hp::bench::CPBenchOptions bench;
  int nproc = 2;
  std::string algo = "all_gather", schedule = "sync";
  int64_t degree = 0;
  bool json = false;
  double timeout_s = 600;
};
int run_cp(CPArgs a, const std::vector<std::string>& argv);

struct HsdpArgs {
  hp::bench::HsdpBenchOptions bench;
  int nproc = 2;
  std::string fusion = "off";
  bool json = false;
  double timeout_s = 600;
};
int run_hsdp(HsdpArgs a, const std::vector<std::string>& argv);

int run_calibrate(const std::string& out);
int run_report_cmd(hp::bench::ReportOptions o);

}  // namespace hp_bench
