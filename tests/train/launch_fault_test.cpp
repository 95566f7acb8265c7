// The local launcher under faults, end to end through hp-train --nproc (issue 13, items 6-9 and
// --max-restarts): where the rendezvous listens, ranks dying with their launcher (kill -9,
// hang-up) and leaving no temporary files, the one default group timeout and the --timeout check,
// the summary naming the rank that failed or hung first, and restarts from the last checkpoint.
//
// Every job runs a tiny model for many steps with a seed of its own, so a process that outlives
// a test can be recognised by its command line and ended by its pid.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// --- Item 8: one default group timeout; --timeout checked before anything starts ---------------

TEST(GroupTimeout, EveryToolDocumentsTheSameDefault) {
  for (const std::string& cmd :
       {std::string(HP_TRAIN_BINARY) + " --help", std::string(HP_BENCH_BINARY) + " comm --help",
        std::string(HP_BENCH_BINARY) + " cp --help",
        std::string(HP_BENCH_BINARY) + " hsdp --help"}) {
    auto r = hp::testing::run_command(cmd);
    const auto at = r.out.find("--timeout");
    ASSERT_NE(at, std::string::npos) << cmd << "\n" << r.out;
    const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_NE(line.find("300"), std::string::npos) << cmd << ": " << line;
  }
}

TEST(GroupTimeout, BadValuesAreRefusedBeforeAnyRankStarts) {
  const std::vector<std::string> tools{
      std::string(HP_TRAIN_BINARY) + " --nproc 2 --cp 2",
      std::string(HP_BENCH_BINARY) + " comm --nproc 2",
      std::string(HP_BENCH_BINARY) + " cp --nproc 2 --seq 64",
      std::string(HP_BENCH_BINARY) + " hsdp --nproc 2 --dp-shard 2"};
  for (const auto& tool : tools) {
    for (const std::string bad : {"0", "-5", "nan", "inf"}) {
      auto r = hp::testing::run_command(tool + " --timeout " + bad);
      EXPECT_NE(r.rc, 0) << tool << " --timeout " << bad << "\n" << r.out;
      EXPECT_NE(r.out.find("--timeout " + bad + " is not valid"), std::string::npos)
          << tool << " --timeout " << bad << "\n"
          << r.out;
      EXPECT_EQ(r.out.find("rank "), std::string::npos) << "ranks were started\n" << r.out;
    }
  }
}

}  // namespace
