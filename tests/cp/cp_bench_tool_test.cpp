// hp-bench cp end to end: steps paired in one run (documents against none, async against sync,
// another algorithm, contiguous against balanced shards), the fresh host pages and tensor peak
// of a step, the trace, the flags refused where they would do nothing; and hp-bench attention's
// children under the tool's host allocator.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "calibration_file.h"
#include "hp/common/trace.h"
#include "rank_harness.h"
#include "tool_json.h"

namespace {

using hp::testing::last_json;

// hp-bench cp --documents: each timed step is paired with a step of the same batch without
// documents (speed-up measured in one run); without --documents there is no paired step. With 4
// documents that are the balanced shards' chunks, sync all_gather moves nothing; with 3 it
// gathers, and the counted bytes (the packed steps' only) equal the formula.
TEST(CPBench, DocumentsArePairedWithTheSameBatchWithout) {
  const std::string cmd =
      std::string(HP_BENCH_BINARY) +
      " cp --seq 512 --heads 2 --kv-heads 2 --head-dim 8 --causal --cp 2 --iters 2 "
      "--load-balance --json";
  for (int docs : {4, 3}) {
    auto r = hp::testing::run_command(cmd + " --documents " + std::to_string(docs));
    ASSERT_EQ(r.rc, 0) << r.out;
    auto res = last_json(r.out)["results"];
    ASSERT_EQ(res.size(), 1u) << r.out;
    EXPECT_EQ(res[0]["documents"], docs);
    const double with = res[0]["step_time_s"], without = res[0]["step_time_without_documents_s"];
    EXPECT_GT(with, 0) << r.out;
    EXPECT_GT(without, 0) << r.out;
    EXPECT_GT(res[0]["documents_speedup"].get<double>(), 0) << r.out;
    EXPECT_EQ(res[0]["comm_bytes_per_rank"],
              docs == 4 ? nlohmann::json(0) : res[0]["comm_bytes_theory"])
        << r.out;
  }
  auto plain = hp::testing::run_command(cmd);
  ASSERT_EQ(plain.rc, 0) << plain.out;
  auto p = last_json(plain.out)["results"][0];
  EXPECT_EQ(p["step_time_without_documents_s"], 0.0) << plain.out;
  EXPECT_EQ(p["documents_speedup"], 0.0) << plain.out;
  EXPECT_EQ(p["async_speedup"], 0.0) << plain.out;
}

// hp-bench cp --schedule async: the sync schedule's steps alternate with the async schedule's
// in one run; each keeps its own figures, the async result carries the paired ratio, and with
// documents each schedule has its own pair. Both skip the gathers the documents make useless
// (async because the layer announces its options before the projections).
TEST(CPBench, AsyncStepsArePairedWithSyncSteps) {
  const std::string cmd =
      std::string(HP_BENCH_BINARY) +
      " cp --seq 512 --heads 2 --kv-heads 2 --head-dim 8 --causal --cp 2 --iters 2 "
      "--load-balance --schedule async --projections --json --documents 4";
  auto r = hp::testing::run_command(cmd);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto res = last_json(r.out)["results"];
  ASSERT_EQ(res.size(), 2u) << r.out;
  EXPECT_EQ(res[0]["schedule"], "sync");
  EXPECT_EQ(res[1]["schedule"], "async");
  EXPECT_EQ(res[0]["async_speedup"], 0.0) << r.out;
  EXPECT_GT(res[1]["async_speedup"].get<double>(), 0) << r.out;
  EXPECT_EQ(res[0]["comm_bytes_per_rank"], 0) << r.out;  // the documents hide the other rank
  EXPECT_EQ(res[1]["comm_bytes_per_rank"], 0) << r.out;
  for (const auto& x : res) {
    EXPECT_GT(x["step_time_s"].get<double>(), 0) << r.out;
    // A step's own peak: measured on every rank, part of the process's peak.
    ASSERT_EQ(x["step_peak_per_rank"].size(), 2u) << r.out;
    EXPECT_GT(x["step_peak_bytes"].get<int64_t>(), 0) << r.out;
    EXPECT_LT(x["step_peak_bytes"].get<int64_t>(), x["peak_rss_bytes"].get<int64_t>()) << r.out;
    EXPECT_GT(x["step_time_without_documents_s"].get<double>(), 0) << r.out;
    EXPECT_GT(x["documents_speedup"].get<double>(), 0) << r.out;
  }
  EXPECT_GE(res[1]["peak_rss_bytes"].get<int64_t>(), res[0]["peak_rss_bytes"].get<int64_t>());
  // --always-local-first is async all_gather's and hybrid's: refused (before any rank starts)
  // elsewhere.
  auto bad = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " cp --seq 512 --heads 2 --kv-heads 2 --cp 2 --iters 1 "
                                      "--always-local-first --cp-algo ulysses --schedule async");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(
      bad.out.find(
          "--always-local-first applies to --cp-algo all_gather or hybrid with --schedule async"),
      std::string::npos)
      << bad.out;
}

// `hp-bench cp` with `args` (and --json): its results, of which there must be `n`.
nlohmann::json paired_results(const std::string& args, size_t n) {
  auto r = hp::testing::run_command(std::string(HP_BENCH_BINARY) + " cp " + args + " --json");
  EXPECT_EQ(r.rc, 0) << r.out;
  auto res = r.rc == 0 ? last_json(r.out)["results"] : nlohmann::json::array();
  EXPECT_EQ(res.size(), n) << r.out;
  return res.size() == n ? res : nlohmann::json();
}

// --paired-with: the named algorithm's layer (sync, balanced where it can be) timed in
// alternation with the one under test; its result first, the ratio on the second; each keeps
// its own bytes (the ring's 3 blocks of P-1 against Ulysses' all-to-alls) and balance.
TEST(CPBench, PairedWithTimesAnotherAlgorithmInAlternation) {
  auto res = paired_results(
      "--seq 512 --heads 4 --kv-heads 4 --head-dim 8 --causal --cp 2 --iters 2 --cp-algo ring "
      "--load-balance --paired-with ulysses --reference-step",
      2);
  ASSERT_FALSE(res.is_null());
  EXPECT_EQ(res[0]["algorithm"], "ulysses");
  EXPECT_EQ(res[1]["algorithm"], "ring");
  EXPECT_EQ(res[0]["load_balance"], false);
  EXPECT_EQ(res[1]["load_balance"], true);
  EXPECT_EQ(res[0]["paired_speedup"], 0.0) << res;
  EXPECT_GT(res[1]["paired_speedup"].get<double>(), 0) << res;
  for (const auto& x : res) {
    EXPECT_GT(x["step_time_s"].get<double>(), 0) << res;
    EXPECT_EQ(x["comm_bytes_per_rank"], x["comm_bytes_theory"]) << res;
  }
  EXPECT_NE(res[0]["comm_bytes_per_rank"], res[1]["comm_bytes_per_rank"]) << res;
  // --reference-step: one reference time per run, on every result.
  EXPECT_GT(res[0]["reference_step_s"].get<double>(), 0) << res;
  EXPECT_EQ(res[0]["reference_step_s"], res[1]["reference_step_s"]) << res;
  // Refused before any rank starts: an algorithm it does not pair, an async or packed layer.
  for (const auto& [flags, expect] : std::vector<std::pair<std::string, std::string>>{
           {"--paired-with hybrid",
            "--paired-with=hybrid is not supported; use all_gather, "
            "ulysses, ring or contiguous"},
           {"--paired-with ulysses --schedule async",
            "--paired-with pairs two sync layers without documents"},
           {"--paired-with ulysses --documents 2",
            "--paired-with pairs two sync layers without documents"}}) {
    auto bad =
        hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                 " cp --seq 512 --heads 2 --kv-heads 2 --cp 2 --iters 1 " + flags);
    EXPECT_NE(bad.rc, 0) << flags;
    EXPECT_NE(bad.out.find(expect), std::string::npos) << bad.out;
  }
}

// --paired-with contiguous: the same layer and schedule on contiguous shards, timed in
// alternation with the balanced one; under async the balanced sync layer runs too, and the
// sync/async ratio stays between the balanced pair while the last result carries the balance
// ratio. Refused without --load-balance.
TEST(CPBench, PairedWithContiguousTimesTheSameLayerUnbalanced) {
  auto res = paired_results(
      "--seq 512 --heads 4 --kv-heads 4 --head-dim 8 --causal --cp 2 --iters 2 --cp-algo "
      "all_gather --load-balance --schedule async --paired-with contiguous",
      3);
  ASSERT_FALSE(res.is_null());
  EXPECT_EQ(res[0]["load_balance"], false);
  EXPECT_EQ(res[0]["schedule"], "async");
  EXPECT_EQ(res[1]["load_balance"], true);
  EXPECT_EQ(res[1]["schedule"], "sync");
  EXPECT_EQ(res[2]["load_balance"], true);
  EXPECT_EQ(res[2]["schedule"], "async");
  EXPECT_EQ(res[0]["paired_speedup"], 0.0) << res;
  EXPECT_EQ(res[1]["paired_speedup"], 0.0) << res;
  EXPECT_GT(res[2]["paired_speedup"].get<double>(), 0) << res;
  EXPECT_EQ(res[0]["async_speedup"], 0.0) << res;
  EXPECT_EQ(res[1]["async_speedup"], 0.0) << res;
  EXPECT_GT(res[2]["async_speedup"].get<double>(), 0) << res;
  for (const auto& x : res) {
    EXPECT_GT(x["step_time_s"].get<double>(), 0) << res;
    EXPECT_EQ(x["comm_bytes_per_rank"], x["comm_bytes_theory"]) << res;
  }
  auto bad = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " cp --seq 512 --heads 2 --kv-heads 2 --cp 2 --iters 1 "
                                      "--paired-with contiguous");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("--paired-with contiguous pairs a balanced layer"), std::string::npos)
      << bad.out;
}

// Under the caching host allocator (the tools' default) a timed step repeats the one before it
// and takes no fresh pages from the system, sync or async (a CP layer's 8, 16 and 24 MiB
// tensors interleave); with LibTorch's allocator the figure is absent (-1). The figure is the
// median over the timed steps: three, so that one step whose async frees came late on a busy
// machine (seen under ctest -j2) does not decide it.
TEST(CPBench, RepeatedStepsTakeNoFreshHostPages) {
  const std::string cmd = std::string(HP_BENCH_BINARY) +
                          " cp --seq 8192 --heads 4 --kv-heads 4 --head-dim 64 --causal --cp 2 "
                          "--iters 3 --cp-algo all_gather --schedule async --load-balance "
                          "--projections --json";
  auto r = hp::testing::run_command(cmd);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto res = last_json(r.out)["results"];
  ASSERT_EQ(res.size(), 2u) << r.out;
  for (const auto& x : res)
    EXPECT_EQ(x["fresh_host_bytes_per_step"].get<int64_t>(), 0) << x["schedule"] << r.out;
  auto sys = hp::testing::run_command(
      std::string(HP_BENCH_BINARY) +
      " cp --seq 512 --heads 2 --kv-heads 2 --cp 2 --iters 1 --host-allocator system --json");
  ASSERT_EQ(sys.rc, 0) << sys.out;
  EXPECT_EQ(last_json(sys.out)["results"][0]["fresh_host_bytes_per_step"].get<int64_t>(), -1)
      << sys.out;
}

// step_tensor_peak_bytes counts live tensor storage at the allocator: at least what the
// strategy must hold (all_gather: the gathered K and V) and far below a whole-sequence [S, S]
// tensor. (When other threads free their tensors moves it a little between runs.)
TEST(CPBench, StepTensorPeakIsCountedAtTheAllocator) {
  const std::string cmd = std::string(HP_BENCH_BINARY) +
                          " cp --seq 512 --heads 4 --kv-heads 4 --head-dim 8 --causal --cp 2 "
                          "--iters 2 --cp-algo all_gather --json";
  auto r = hp::testing::run_command(cmd);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto res = last_json(r.out)["results"][0];
  const auto per_rank = res["step_tensor_peak_per_rank"].get<std::vector<int64_t>>();
  ASSERT_EQ(per_rank.size(), 2u) << r.out;
  const int64_t gathered_kv = 2 * 512 * 4 * 8 * 4;  // full K and V, fp32
  const int64_t scores = 4 * 512 * 512 * 4;         // one [H, S, S] fp32 score tensor
  for (int64_t b : per_rank) {
    EXPECT_GE(b, gathered_kv) << r.out;
    EXPECT_LT(b, scores) << r.out;
  }
  EXPECT_EQ(res["step_tensor_peak_bytes"].get<int64_t>(),
            *std::max_element(per_rank.begin(), per_rank.end()));
}

// The ring never holds the whole sequence's K/V: at P = 8 (S = 16384, 2 heads, D = 64, fp32:
// the whole K and V are 16 MiB, a rank's block 2 MiB) every ring rank's step peaks at least half
// the whole K/V below the smallest all_gather rank's, which holds it all (and its gradient).
// Measured 9.6-20.1 MiB against 34.0 MiB. Both layers in one run (--paired-with).
TEST(CPBench, TheRingNeverHoldsTheWholeSequence) {
  auto r = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                    " cp --seq 16384 --heads 2 --kv-heads 2 --head-dim 64 "
                                    "--causal --cp 8 --iters 1 --cp-algo all_gather --paired-with "
                                    "ring --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto res = last_json(r.out)["results"];
  ASSERT_EQ(res.size(), 2u) << r.out;
  ASSERT_EQ(res[0]["algorithm"], "ring") << r.out;
  ASSERT_EQ(res[1]["algorithm"], "all_gather") << r.out;
  const auto ring = res[0]["step_tensor_peak_per_rank"].get<std::vector<int64_t>>();
  const auto gathered = res[1]["step_tensor_peak_per_rank"].get<std::vector<int64_t>>();
  ASSERT_EQ(ring.size(), 8u);
  ASSERT_EQ(gathered.size(), 8u);
  const int64_t whole_kv = 2 * 16384 * 2 * 64 * 4;
  const int64_t gathered_min = *std::min_element(gathered.begin(), gathered.end());
  EXPECT_GE(gathered_min, whole_kv) << r.out;
  for (int64_t b : ring)
    EXPECT_LE(b + whole_kv / 2, gathered_min) << r.out;
}

// hp-bench cp --trace: one Chrome-trace file of both ranks; each timed step is a "step" event
// named by its variant (2 sync, 2 async per rank here), and inside every one of them the rank
// launched and waited for its K/V all-gathers and ran attention calls. Refused with
// --attention mla (whose bench records no trace) instead of ignored.
TEST(CPBench, TraceHoldsEveryRanksTimedStepsWithTheirCollectivesAndAttention) {
  const auto path = (std::filesystem::temp_directory_path() /
                     ("hp_cp_bench_trace_" + std::to_string(::getpid()) + ".json"))
                        .string();
  const std::string cmd = std::string(HP_BENCH_BINARY) +
                          " cp --seq 256 --heads 2 --kv-heads 2 --head-dim 8 --causal --cp 2 "
                          "--iters 2 --schedule async --trace " +
                          path;
  auto r = hp::testing::run_command(cmd);
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto events = hp::common::read_chrome_trace(path);
  std::filesystem::remove(path);
  for (int rank : {0, 1}) {
    std::map<std::string, int> steps;
    for (const auto& step : events) {
      if (step.rank != rank || step.category != "step") continue;
      ++steps[step.name];
      int gathers = 0, waits = 0, attention = 0, backward = 0;
      int64_t last_forward_begin = 0, first_backward_begin = INT64_MAX;
      for (const auto& e : events) {
        if (e.rank != rank || e.begin_us < step.begin_us || e.end_us > step.end_us) continue;
        gathers += e.category == "comm" && e.name == "all_gather";
        waits += e.category == "comm_wait" && e.name == "wait all_gather";
        if (e.category == "compute" && e.name == "attention") {
          ++attention;
          last_forward_begin = std::max(last_forward_begin, e.begin_us);
        }
        if (e.category == "compute" && e.name == "attention_backward") {
          ++backward;
          first_backward_begin = std::min(first_backward_begin, e.begin_us);
        }
      }
      EXPECT_GE(gathers, 2) << step.name << " of rank " << rank;
      EXPECT_GE(waits, 2) << step.name << " of rank " << rank;
      EXPECT_GE(attention, 1) << step.name << " of rank " << rank;
      // Every call's backward, once the forward is done.
      EXPECT_EQ(backward, attention) << step.name << " of rank " << rank;
      EXPECT_GT(first_backward_begin, last_forward_begin) << step.name << " of rank " << rank;
    }
    EXPECT_EQ(steps, (std::map<std::string, int>{{"step all_gather/sync", 2},
                                                 {"step all_gather/async", 2}}))
        << "rank " << rank;
  }
  auto bad = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " cp --attention mla --seq 64 --heads 2 --cp 1 --iters 1 "
                                      "--trace " +
                                      path);
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("--trace does not apply to --attention mla"), std::string::npos)
      << bad.out;
}

// Flags that would not run are refused before any rank starts, each naming the flag: what
// --cp-algo auto chooses itself, MLA/DSA dims with softmax attention, DSA's with MLA, and
// softmax-only flags with DSA.
TEST(CPBench, FlagsThatWouldNotRunAreRefused) {
  const std::string bench =
      std::string(HP_BENCH_BINARY) + " cp --seq 64 --heads 2 --cp 2 --iters 1 ";
  for (const auto& [args, text] : std::vector<std::pair<std::string, std::string>>{
           {"--cp-algo auto --schedule async --ring-keep-blocks",
            "--cp-algo auto chooses the strategy, its schedule and its Ulysses degree with each "
            "strategy's defaults, so --schedule, --ring-keep-blocks would not run; drop them"},
           {"--topk 8", "--topk applies to --attention mla or dsa, not to softmax attention"},
           {"--attention mla --index-heads 2",
            "--index-heads applies to --attention dsa only (got --attention mla)"},
           {"--attention dsa --ring-backward blocks",
            "--ring-backward does not apply to --attention dsa"},
           {"--attention mla --kv-head-policy repeat",
            "--kv-head-policy does not apply to --attention mla"},
           {"--cp-algo ulysses --kv-heads 1",
            "K/V heads are never repeated silently: set kv_head_policy=repeat "
            "(--kv-head-policy repeat)"}}) {
    auto r = hp::testing::run_command(bench + args);
    EXPECT_EQ(r.rc, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(text), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find("step"), std::string::npos) << args << "\n" << r.out;
  }
  // The other subcommands' tile and chunk sizes where their kernel has none.
  for (const auto& [args, text] : std::vector<std::pair<std::string, std::string>>{
           {"attention --seq 64 --primitive math --block-q 16",
            "--block-q sizes the blockwise primitive's tiles; --primitive math has none"},
           {"linear --kernel recurrent --chunk-size 16",
            "--chunk-size sizes the chunked kernel's chunks; --kernel recurrent runs token by "
            "token"}}) {
    auto r = hp::testing::run_command(std::string(HP_BENCH_BINARY) + " " + args);
    EXPECT_EQ(r.rc, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(text), std::string::npos) << args << "\n" << r.out;
  }
}

// --kv-head-policy repeat: one K/V head for a Ulysses degree of 2, sync and async; each rank's
// counted bytes equal the formula, which sends that head once. (What async sends in head
// groups: KVHeadPolicy.RepeatHandsEachRankOnlyTheHeadItReadsAndTheDefaultRefuses.)
TEST(CPBench, KVHeadRepeatRunsWithCountedBytesEqualToTheFormula) {
  auto r = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                    " cp --seq 256 --heads 4 --kv-heads 1 --head-dim 8 --causal "
                                    "--cp 2 --cp-algo ulysses --kv-head-policy repeat --schedule "
                                    "async --projections --iters 1 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto res = last_json(r.out)["results"];
  ASSERT_EQ(res.size(), 2u) << r.out;
  for (const auto& x : res) {
    EXPECT_EQ(x["kv_head_policy"], "repeat") << x;
    for (const auto& b : x["comm_bytes_by_rank"])
      EXPECT_EQ(b, x["comm_bytes_theory"]) << x;
    // Forward, Q and the output: half of 4 heads x 128 positions x 8 dims x 4 bytes each way;
    // K and V: one head's 128 positions to the other rank. Backward the same again.
    EXPECT_EQ(x["comm_bytes_per_rank"].get<int64_t>(), 2 * (2 * 2 * 128 * 8 * 4 + 2 * 128 * 8 * 4))
        << x;
  }
}

// --paired-with ulysses beside a layer that moves every K/V head whole (all_gather, ring), with
// too few K/V heads: --kv-head-policy repeat is the paired Ulysses layer's (it was refused for
// the all_gather layer, and the paired layer refused without it). Each row records the policy
// that ran, and the repeating layer's bytes equal the formula.
TEST(CPBench, PairedUlyssesTakesTheRepeatPolicyBesideAWholeKVLayer) {
  const std::string base = std::string(HP_BENCH_BINARY) +
                           " cp --seq 256 --heads 4 --kv-heads 1 --head-dim 8 --causal --cp 2 "
                           "--iters 1 --paired-with ulysses ";
  for (const std::string algo : {"all_gather", "ring"}) {
    auto r =
        hp::testing::run_command(base + "--cp-algo " + algo + " --kv-head-policy repeat --json");
    ASSERT_EQ(r.rc, 0) << r.out;
    const auto res = last_json(r.out)["results"];
    ASSERT_EQ(res.size(), 2u) << r.out;
    EXPECT_EQ(res[0]["algorithm"], "ulysses") << res;
    EXPECT_EQ(res[0]["kv_head_policy"], "repeat") << res;
    EXPECT_EQ(res[1]["algorithm"], algo) << res;
    EXPECT_EQ(res[1]["kv_head_policy"], "error") << res;
    EXPECT_GT(res[1]["paired_speedup"].get<double>(), 0.0) << res;
    for (const auto& b : res[0]["comm_bytes_by_rank"])
      EXPECT_EQ(b, res[0]["comm_bytes_theory"]) << res;
  }
  // Without the policy the paired layer is refused, and the message names the option.
  auto r = hp::testing::run_command(base + "--cp-algo all_gather");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("--kv-head-policy repeat"), std::string::npos) << r.out;
}

// Each row records what its own layer ran: the sync layer of an async run has no head groups
// or row parts, a paired Ulysses layer no ring backward. At --cp 1 the plain layer runs, so
// the CP flags are refused (they were echoed in the JSON and ignored). --json with --cp-algo
// auto keeps stdout one JSON object (the ranking goes to stderr).
TEST(CPBench, RowsRecordTheirOwnLayerAndOneRankRefusesCPFlags) {
  const std::string base = std::string(HP_BENCH_BINARY) +
                           " cp --seq 256 --heads 4 --kv-heads 4 --head-dim 8 --causal --iters 1 ";
  auto u = hp::testing::run_command(base +
                                    "--cp 2 --cp-algo ulysses --schedule async "
                                    "--ulysses-head-groups 2 --ulysses-row-parts 3 --json");
  ASSERT_EQ(u.rc, 0) << u.out;
  auto rows = last_json(u.out)["results"];
  ASSERT_EQ(rows.size(), 2u) << u.out;
  EXPECT_EQ(rows[0]["schedule"], "sync");
  EXPECT_EQ(rows[0]["ulysses_head_groups"], 0) << rows[0];
  EXPECT_EQ(rows[0]["ulysses_row_parts"], 0) << rows[0];
  EXPECT_EQ(rows[1]["ulysses_head_groups"], 2) << rows[1];
  EXPECT_EQ(rows[1]["ulysses_row_parts"], 3) << rows[1];
  auto r = hp::testing::run_command(
      base + "--cp 2 --cp-algo ring --ring-backward queries --paired-with ulysses --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  rows = last_json(r.out)["results"];
  ASSERT_EQ(rows.size(), 2u) << r.out;
  EXPECT_EQ(rows[0]["ring_backward"], "auto") << rows[0];
  EXPECT_EQ(rows[1]["ring_backward"], "queries") << rows[1];
  auto one = hp::testing::run_command(base + "--cp 1 --cp-algo ring --ring-keep-blocks --json");
  EXPECT_EQ(one.rc, 1) << one.out;
  EXPECT_NE(one.out.find("hp-bench cp: --cp-algo ring, --ring-keep-blocks configure context "
                         "parallelism, but --cp is 1"),
            std::string::npos)
      << one.out;
  const std::string path = hp::testing::scratch_dir() + "/auto_json_calibration.json";
  hp::testing::write_uniform_calibration(path);
  auto a = hp::testing::run_command("(HP_CALIBRATION=" + path + " " + base +
                                    "--cp 2 --cp-algo auto --json 2>/dev/null)");
  ASSERT_EQ(a.rc, 0) << a.out;
  EXPECT_NO_THROW(nlohmann::json::parse(a.out)) << a.out;
}

// Shapes that cannot run are refused before any rank starts, naming the flags: query heads that
// are not a multiple of the key/value heads (cp and attention), more documents than tokens.
TEST(CPBench, ImpossibleShapesAreRefusedBeforeAnyRank) {
  const std::string bench = std::string(HP_BENCH_BINARY);
  for (const std::string& cmd : {bench + " cp --cp 2 --seq 256 --heads 4 --kv-heads 3 --head-dim 8",
                                 bench + " cp --cp 2 --seq 256 --heads 2 --head-dim 8",
                                 bench + " attention --seq 256 --heads 2 --head-dim 8"}) {
    auto r = hp::testing::run_command(cmd);
    EXPECT_EQ(r.rc, 1) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find(" is not a multiple of --kv-heads "), std::string::npos) << cmd << "\n"
                                                                                  << r.out;
    EXPECT_EQ(r.out.find("rank 0"), std::string::npos) << "no rank may start: " << r.out;
  }
  auto docs = hp::testing::run_command(
      bench + " cp --cp 2 --seq 256 --heads 4 --kv-heads 4 --head-dim 8 --documents 300");
  EXPECT_EQ(docs.rc, 1) << docs.out;
  EXPECT_NE(docs.out.find("hp-bench cp: --documents 300 must be in [0, --seq 256]"),
            std::string::npos)
      << docs.out;
}

// --cp-algo auto with --kv-head-policy repeat: one K/V head over 2 ranks lets the Ulysses
// candidates in (their predictions are printed); the layer that runs carries the policy only
// if it repeats, and its counted bytes equal the formula.
TEST(CPBench, AutoTakesTheKVHeadRepeatPolicy) {
  const std::string path = hp::testing::scratch_dir() + "/auto_repeat_calibration.json";
  hp::testing::write_uniform_calibration(path);
  auto r = hp::testing::run_command("HP_CALIBRATION=" + path + " " + HP_BENCH_BINARY +
                                    " cp --seq 256 --heads 4 --kv-heads 1 --head-dim 8 --causal "
                                    "--cp 2 --iters 1 --cp-algo auto --kv-head-policy repeat "
                                    "--json");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("predicted ulysses/sync:"), std::string::npos) << r.out;
  const auto res = last_json(r.out)["results"];
  ASSERT_FALSE(res.empty()) << r.out;
  for (const auto& x : res) {
    EXPECT_EQ(x["kv_head_policy"], x["algorithm"] == "ulysses" ? "repeat" : "error") << x;
    for (const auto& b : x["comm_bytes_by_rank"])
      EXPECT_EQ(b, x["comm_bytes_theory"]) << x;
  }
}

// hp-bench attention measures each primitive in a child process of its own: the child runs under
// the tool's --host-allocator (the choice travels on the child's command line).
TEST(AttentionBench, ChildrenRunUnderTheToolsHostAllocator) {
  for (const std::string choice : {"caching", "system"}) {
    auto r = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " attention --seq 64 --heads 2 --kv-heads 2 --head-dim 16 "
                                      "--primitive blockwise --iters 1 --json --host-allocator " +
                                      choice);
    ASSERT_EQ(r.rc, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    ASSERT_EQ(j["results"].size(), 1u) << j;
    EXPECT_EQ(j["results"][0]["host_allocator"], choice) << j;
  }
}

}  // namespace
