// Real processes: TCPStore rendezvous from launcher variables, a peer that dies or never
// arrives, the launcher's teardown, and hp-bench comm end to end.
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hp/comm/collectives.h"
#include "hp/comm/launcher.h"
#include "hp/comm/store.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"
#include "rank_harness.h"

namespace hp::comm {
namespace {

using hp::testing::run_rank_processes;

TEST(Processes, RendezvousFromTorchrunVariables) {
  auto results = run_rank_processes(3, [](World& w) {
    HP_CHECK(w.size() == 3, "world size ", w.size());
    auto sum = all_reduce(w.group(), at::full({1}, double(w.rank()), at::kDouble));
    HP_CHECK(sum.item<double>() == 3.0, "sum ", sum.item<double>());
    auto g = all_gather(w.group(), at::full({1}, float(w.rank())), 0);
    HP_CHECK(at::equal(g, at::arange(3, at::kFloat)), "gather wrong");
  });
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 0) << "rank " << r.rank << ": " << r.error;
  }
}

TEST(Processes, PeerThatExitsEarlyBecomesAnErrorNotAHang) {
  hp::testing::RankOptions o;
  o.timeout = std::chrono::milliseconds(4000);
  auto results = run_rank_processes(
      3,
      [](World& w) {
        if (w.rank() == 2) return;  // leaves before the collective
        all_reduce(w.group(), at::ones({1024}));
      },
      o, std::chrono::seconds(60));
  EXPECT_EQ(results[2].exit_code, 0);
  for (int r : {0, 1}) {
    EXPECT_EQ(results[r].exit_code, 1)
        << "rank " << r << " should have raised (signal " << results[r].term_signal << ")";
    EXPECT_NE(results[r].error.find("all_reduce on group 'world' (rank " + std::to_string(r) +
                                    " of 3, world rank " + std::to_string(r) + ") failed"),
              std::string::npos)
        << results[r].error;
    EXPECT_LT(results[r].seconds, 30.0);
  }
}

TEST(Processes, HeartbeatOutlivesTheStoreHost) {
  // Rank 0 hosts the store and leaves; rank 1's heartbeat thread keeps writing to the closed
  // connection for a while and must not take the process down (SIGPIPE) or block its exit.
  auto results = run_rank_processes(2, [](World& w) {
    if (w.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  });
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 0) << "rank " << r.rank << " signal " << r.term_signal << ": "
                              << r.error;
    EXPECT_LT(r.seconds, 20.0) << "rank " << r.rank;
  }
}

TEST(Processes, PeerThatNeverArrivesTimesOut) {
  hp::testing::RankOptions o;
  o.timeout = std::chrono::milliseconds(2000);
  auto results = run_rank_processes(
      2,
      [](World& w) {
        if (w.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(6));
          return;
        }
        all_gather(w.group(), at::ones({16}), 0);
      },
      o, std::chrono::seconds(60));
  EXPECT_EQ(results[0].exit_code, 1);
  EXPECT_NE(results[0].error.find("all_gather on group 'world' (rank 0 of 2, world rank 0)"),
            std::string::npos)
      << results[0].error;
  EXPECT_NE(results[0].error.find("within the group timeout of 2000 ms"), std::string::npos)
      << results[0].error;
}

// Rank 0's store listens on MASTER_ADDR's address only (127.0.0.1 here), never on every
// interface; HP_STORE_BIND='*' asks for every interface explicitly.
std::vector<std::string> store_addresses_of_rank0() {
  std::vector<std::string> seen;
  auto results = run_rank_processes(2, [](World& w) {
    if (w.rank() != 0) return;
    const char* port = std::getenv("MASTER_PORT");
    HP_CHECK(port != nullptr, "MASTER_PORT is not set");
    auto a = listening_addresses(std::atoi(port));
    std::string all;
    for (const auto& x : a)
      all += x + " ";
    throw Error("listening:" + all);  // carries the addresses back to the test
  });
  std::istringstream in(results[0].error.substr(results[0].error.find(':') + 1));
  for (std::string a; in >> a;)
    seen.push_back(a);
  EXPECT_EQ(results[1].exit_code, 0) << results[1].error;
  return seen;
}

TEST(Store, RankZeroListensOnMasterAddrOnly) {
  const auto seen = store_addresses_of_rank0();
  ASSERT_FALSE(seen.empty());
  for (const auto& a : seen)
    EXPECT_TRUE(a == "127.0.0.1" || a == "::ffff:127.0.0.1") << a;
}

TEST(Store, EveryInterfaceOnlyWhenAskedFor) {
  ::setenv("HP_STORE_BIND", "*", 1);
  const auto seen = store_addresses_of_rank0();
  ::unsetenv("HP_STORE_BIND");
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_TRUE(seen[0] == "::" || seen[0] == "0.0.0.0") << seen[0];
}

TEST(Store, ServerOnAnAddressOfAnotherHostFailsNamingIt) {
  StoreServerOptions o;
  o.bind_address = "203.0.113.7";  // TEST-NET-3: not an address of this host
  o.timeout = std::chrono::seconds(2);
  HP_EXPECT_ERROR(serve_store(o), "rendezvous store: cannot listen on 203.0.113.7 port 0");
  o.bind_address = "localhost";
  auto store = serve_store(o);
  const auto seen = listening_addresses(store->getPort());
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_TRUE(seen[0] == "127.0.0.1" || seen[0] == "::ffff:127.0.0.1") << seen[0];
}

TEST(Launcher, OneFailingRankStopsTheOthers) {
  hp::comm::LaunchOptions lo;
  lo.nproc = 3;
  lo.grace = std::chrono::milliseconds(1000);
  lo.argv = {"/bin/sh", "-c",
             "if [ \"$RANK\" = 1 ]; then echo 'rank one broke' > \"$HP_ERROR_FILE\"; exit 3; fi; "
             "exec sleep 60"};
  auto t0 = std::chrono::steady_clock::now();
  auto res = hp::comm::launch_local_ranks(lo);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(res.exit_code, 3);
  EXPECT_EQ(res.failed_rank, 1);
  EXPECT_NE(res.message.find("rank 1 (pid"), std::string::npos) << res.message;
  EXPECT_NE(res.message.find("exited with code 3: rank one broke"), std::string::npos)
      << res.message;
  EXPECT_LT(secs, 20.0) << "the sleeping ranks were not stopped";
}

TEST(Launcher, OwnErrorIsBlamedBeforeTheCommErrorsItCaused) {
  // Rank 0 fails first, but with a communication error (tagged as report_rank_error(CommError)
  // tags it); rank 2's own error, a moment later, is the cause.
  hp::comm::LaunchOptions lo;
  lo.nproc = 3;
  lo.grace = std::chrono::milliseconds(1000);
  lo.settle = std::chrono::milliseconds(2000);
  lo.argv = {
      "/bin/sh", "-c",
      "case $RANK in "
      "0) printf 'hp-error-kind: comm\\nrecv from rank 2 failed' > \"$HP_ERROR_FILE\"; exit 1;;"
      "2) sleep 0.3; echo 'checkpoint unreadable' > \"$HP_ERROR_FILE\"; exit 2;;"
      "esac; exec sleep 60"};
  auto res = hp::comm::launch_local_ranks(lo);
  EXPECT_EQ(res.failed_rank, 2) << res.message;
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_EQ(res.message.rfind("rank 2 (pid ", 0), 0u) << res.message;
  EXPECT_NE(res.message.find("exited with code 2: checkpoint unreadable"), std::string::npos)
      << res.message;
  EXPECT_EQ(res.message.find("hp-error-kind"), std::string::npos) << res.message;
}

TEST(Launcher, StoppedRankIsBlamedForThePeersThatWaitedForIt) {
  hp::comm::LaunchOptions lo;
  lo.nproc = 2;
  lo.grace = std::chrono::milliseconds(1000);
  lo.argv = {"/bin/sh", "-c",
             "if [ \"$RANK\" = 1 ]; then kill -STOP $$; fi; sleep 0.5; "
             "printf 'hp-error-kind: comm\\ntimed out' > \"$HP_ERROR_FILE\"; exit 1"};
  auto t0 = std::chrono::steady_clock::now();
  auto res = hp::comm::launch_local_ranks(lo);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(res.failed_rank, 1) << res.message;
  EXPECT_EQ(res.message.rfind("rank 1 (pid ", 0), 0u) << res.message;
  EXPECT_NE(res.message.find("stopped making progress"), std::string::npos) << res.message;
  EXPECT_NE(res.message.find("its process is stopped"), std::string::npos) << res.message;
  EXPECT_NE(res.message.find("then rank 0 (pid "), std::string::npos) << res.message;
  EXPECT_EQ(res.exit_code, 1);
  EXPECT_LT(secs, 20.0) << "the stopped rank was not ended";
}

TEST(Launcher, RestartsAllRanksUpToMaxRestarts) {
  hp::comm::LaunchOptions lo;
  lo.nproc = 2;
  lo.grace = std::chrono::milliseconds(1000);
  lo.max_restarts = 2;
  std::vector<int> attempts;
  lo.argv_for_attempt = [&](int attempt) {
    attempts.push_back(attempt);
    // Rank 1 fails in the first run only.
    return std::vector<std::string>{
        "/bin/sh", "-c",
        attempt == 0 ? "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60" : "exit 0"};
  };
  std::vector<std::string> lines;
  lo.log = [&](const std::string& line) { lines.push_back(line); };
  auto res = hp::comm::launch_local_ranks(lo);
  EXPECT_EQ(res.exit_code, 0) << res.message;
  EXPECT_EQ(res.restarts, 1);
  EXPECT_EQ(attempts, (std::vector<int>{0, 1}));
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("rank 1 (pid ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find("exited with code 3; stopped the other ranks; restarting all ranks "
                          "(restart 1 of 2)"),
            std::string::npos)
      << lines[0];

  // A rank that keeps failing: the last run's failure after max_restarts restarts.
  lo.argv_for_attempt = nullptr;
  lo.argv = {"/bin/sh", "-c", "if [ \"$RANK\" = 0 ]; then exit 5; fi; exec sleep 60"};
  lines.clear();
  res = hp::comm::launch_local_ranks(lo);
  EXPECT_EQ(res.exit_code, 5);
  EXPECT_EQ(res.failed_rank, 0);
  EXPECT_EQ(res.restarts, 2);
  EXPECT_EQ(lines.size(), 2u);
}

// A rank that refused its own options or inputs (one of the program's checks) is not restarted:
// the same command would refuse again. The message says why and how many restarts were left.
TEST(Launcher, CheckErrorsAreNotRestarted) {
  hp::comm::LaunchOptions lo;
  lo.nproc = 2;
  lo.grace = std::chrono::milliseconds(1000);
  lo.max_restarts = 2;
  int attempts = 0;
  lo.argv_for_attempt = [&](int) {
    ++attempts;
    return std::vector<std::string>{
        "/bin/sh", "-c",
        "if [ \"$RANK\" = 1 ]; then printf 'hp-error-kind: check\\n--vocab 16 is too small' > "
        "\"$HP_ERROR_FILE\"; exit 1; fi; exec sleep 60"};
  };
  std::vector<std::string> lines;
  lo.log = [&](const std::string& line) { lines.push_back(line); };
  auto res = hp::comm::launch_local_ranks(lo);
  EXPECT_EQ(res.exit_code, 1) << res.message;
  EXPECT_EQ(res.failed_rank, 1);
  EXPECT_TRUE(res.check_error);
  EXPECT_EQ(attempts, 1);
  EXPECT_EQ(res.restarts, 0);
  EXPECT_TRUE(lines.empty());
  EXPECT_NE(res.message.find("exited with code 1: --vocab 16 is too small; stopped the other "
                             "ranks; not restarting (2 restarts left): the rank refused the "
                             "run's own options or inputs"),
            std::string::npos)
      << res.message;
}

TEST(Launcher, RankErrorReports) {
  const std::string path = hp::testing::scratch_dir() + "/rank_error";
  ::setenv("HP_ERROR_FILE", path.c_str(), 1);
  auto read = [&] {
    std::ifstream f(path);
    return std::string((std::istreambuf_iterator<char>(f)), {});
  };
  hp::comm::report_rank_error(hp::CommError("recv timed out"));
  EXPECT_EQ(read(), "hp-error-kind: comm\nrecv timed out");  // the launcher's tag: a consequence
  hp::comm::report_rank_error(hp::Error("bad input"));
  EXPECT_EQ(read(), "hp-error-kind: check\nbad input");  // a check: a restart would repeat it
  try {
    TORCH_CHECK(false, "zip archive broken");
  } catch (const c10::Error& e) {
    hp::comm::report_rank_error(e);
  }
  EXPECT_EQ(read(), "zip archive broken");  // no backtrace in the launcher's summary
  ::unsetenv("HP_ERROR_FILE");
}

TEST(Launcher, SetsRankVariablesAndThreadCounts) {
  hp::comm::LaunchOptions lo;
  lo.nproc = 2;
  lo.threads_per_rank = 1;
  lo.argv = {"/bin/sh", "-c",
             "test \"$WORLD_SIZE\" = 2 && test \"$OPENBLAS_NUM_THREADS\" = 1 && "
             "test -n \"$MASTER_PORT\" && test \"$LOCAL_RANK\" = \"$RANK\""};
  auto res = hp::comm::launch_local_ranks(lo);
  EXPECT_EQ(res.exit_code, 0) << res.message;
}

// torchrun's static rendezvous: its agent serves the store on MASTER_PORT before the workers
// start (here the test process does) and tells them TORCHELASTIC_USE_AGENT_STORE=True; every
// rank joins it, rank 0 included (rank 0 used to try to serve the taken port and fail).
TEST(HpBenchComm, JoinsTorchrunsAgentStore) {
  StoreServerOptions so;
  so.bind_address = "127.0.0.1";
  so.port = 0;
  so.num_workers = 1;
  auto agent = serve_store(so);
  const std::string vars = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                           std::to_string(agent->getPort()) +
                           " TORCHELASTIC_USE_AGENT_STORE=True TORCHELASTIC_RESTART_COUNT=0 ";
  const std::string rank = std::string(HP_BENCH_BINARY) + " comm --bytes 4096 --iters 1 --json";
  auto run = hp::testing::run_command(
      "(" + vars + "RANK=0 LOCAL_RANK=0 " + rank + " > " + ::testing::TempDir() +
      "/agent_rank0.json & " + vars + "RANK=1 LOCAL_RANK=1 " + rank + " > /dev/null & wait %1 && " +
      "wait %2) && cat " + ::testing::TempDir() + "/agent_rank0.json");
  ASSERT_EQ(run.rc, 0) << run.out;
  auto j = nlohmann::json::parse(run.out.substr(run.out.find('{')));
  EXPECT_EQ(j["nproc"], 2) << run.out;
}

// A rank that never starts: rank 0 (alone, of WORLD_SIZE=3) names the two missing ranks after
// one timeout. It used to wait about two timeouts and blame the world group's creation.
TEST(HpBenchComm, RanksThatNeverJoinAreNamedAfterOneTimeout) {
  const std::string vars =
      "WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 RANK=0 LOCAL_RANK=0 MASTER_PORT=" +
      std::to_string(pick_free_port()) + " ";
  const auto start = std::chrono::steady_clock::now();
  auto run = hp::testing::run_command(vars + std::string(HP_BENCH_BINARY) +
                                      " comm --bytes 4096 --iters 1 --timeout 4");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("rendezvous on rank 0 of 3"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("2 of 3 ranks (ranks 1, 2) did not join within the timeout (4000 ms)"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("Start every rank with WORLD_SIZE=3"), std::string::npos) << run.out;
  EXPECT_LT(seconds, 8.5) << "one timeout of 4 s (plus start-up), not two: " << run.out;
}

// Under an external launcher the job's size is WORLD_SIZE: hp-bench cp's default --nproc (2)
// gives way to it, and an explicit --nproc that disagrees is refused before the rendezvous.
TEST(HpBenchComm, ExternalLauncherSizesTheRun) {
  const std::string vars = "RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 ";
  const std::string cp = std::string(HP_BENCH_BINARY) +
                         " cp --seq 64 --heads 2 --kv-heads 2 --head-dim 8 --iters 1 --json";
  auto plain = hp::testing::run_command(vars + cp + " 2>/dev/null");
  ASSERT_EQ(plain.rc, 0) << plain.out;
  auto j = nlohmann::json::parse(plain.out.substr(plain.out.find('{')));
  EXPECT_EQ(j["results"][0]["cp"], 1) << plain.out;
  auto refused = hp::testing::run_command(vars + cp + " --cp 2");
  EXPECT_EQ(refused.rc, 1) << refused.out;
  EXPECT_NE(refused.out.find("hp-bench cp: --cp 2 spawns local ranks, but this process was "
                             "started by torchrun with a world of 1 ranks; drop --cp"),
            std::string::npos)
      << refused.out;
}

TEST(HpBenchComm, JsonReportsMeasuredBytesEqualToTheFormula) {
  auto run = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " comm --nproc 2 --bytes 1048576 --iters 2 --json");
  ASSERT_EQ(run.rc, 0) << run.out;
  auto j = nlohmann::json::parse(run.out);
  EXPECT_EQ(j["nproc"], 2);
  std::set<std::string> ops;
  for (const auto& row : j["results"]) {
    ops.insert(row["op"]);
    EXPECT_EQ(row["bytes_in"], 1048576);
    EXPECT_EQ(row["bytes_sent_per_rank"], row["theory_bytes_per_rank"]) << row.dump();
    EXPECT_GT(row["gbps"].get<double>(), 0.0);
  }
  EXPECT_EQ(ops,
            (std::set<std::string>{"all_gather", "reduce_scatter", "all_to_all", "all_reduce"}));
}

TEST(HpBenchComm, TraceHasOneTrackPerRank) {
  const std::string path = ::testing::TempDir() + "/hp_bench_comm_trace.json";
  const std::string cmd = std::string(HP_BENCH_BINARY) +
                          " comm --nproc 3 --bytes 65536 --iters 1 --json --trace " + path +
                          " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  auto events = hp::common::read_chrome_trace(path);
  std::set<int> ranks;
  int gathers = 0;
  for (const auto& e : events) {
    ranks.insert(e.rank);
    if (e.name == "all_gather" && e.group == "world") ++gathers;
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(gathers, 3 * 3);  // (warm-up 2 + 1 timed) per rank
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(std::ifstream(path + ".rank" + std::to_string(r)).good()) << "part left behind";
  }
}

}  // namespace
}  // namespace hp::comm
