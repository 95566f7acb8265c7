// hp-bench calibrate / cp --cp-algo auto / report end to end on plain loopback, with the
// calibration cache redirected (HP_CALIBRATION) so the user's cache is never touched. The
// report's contents are checked for coherence: every grid case with its fields, positive
// measured and predicted times, the prediction errors and their maximum recomputed, bytes
// counted equal to the volume formula, the auto choice among the candidates and its time the
// measured one, every case in the markdown tables, and both SVGs well-formed with their bars,
// tracks and events.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hp/bench/calibrate.h"
#include "rank_harness.h"
#include "xml_lite.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string with_cache(const std::string& cal, const std::string& args) {
  return "HP_CALIBRATION=" + cal + " " + std::string(HP_BENCH_BINARY) + " " + args;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

std::string fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// Forward + backward bytes rank `rank` sends in one CP attention layer (DESIGN 5.2), written out
// here independently of hp::cp::forward_bytes_per_rank: fp32, batch 1, data-order balance.
int64_t cp_layer_bytes(const json& m, int64_t rank) {
  const int64_t s = m["seq"], p = m["cp"], d = m["head_dim"];
  const int64_t h = m["heads"].get<int64_t>() * d, hkv = m["kv_heads"].get<int64_t>() * d;
  const int64_t e = 4;
  if (m["algorithm"] == "all_gather") return 2 * (2 * s * hkv * e * (p - 1) / p);
  if (m["algorithm"] == "ulysses") return 2 * ((2 * h + 2 * hkv) * (s / p) * e * (p - 1) / p);
  // ring, causal, head-tail balance at P = 2: rank 0 holds chunks 0 and 3 of s/4 positions,
  // rank 1 chunks 1 and 2. Chunk 3 is attended by no other rank and never leaves; chunk 0
  // reaches rank 1, and rank 1's chunks 2 and 1 both reach rank 0. Forward: those chunks'
  // [k | v]. Backward: the same chunks again and the dK/dV accumulators of the other rank's
  // chunks this rank attended (rank 0: chunks 1 and 2; rank 1: chunk 0), the accumulators alone
  // where forward kept the blocks (ring_keep_blocks), or (ring_backward auto, where [q | dout],
  // [lse | delta] (float32) and the dQ accumulator are fewer bytes per position than the blocks
  // and their accumulators) the query bundles of the chunks that attend the other rank's keys
  // (rank 0: chunk 3; rank 1: chunks 1 and 2) and the dQ accumulators of the other rank's query
  // chunks that attended this rank's keys (rank 0: chunks 1 and 2; rank 1: chunk 3).
  if (m["algorithm"] == "ring") {
    EXPECT_EQ(p, 2);
    EXPECT_TRUE(m["causal"].get<bool>() && m["load_balance"].get<bool>());
    const int64_t heads = m["heads"], kv = 2 * hkv * e, dq = h * e;
    const int64_t bundle = 2 * h * e + 2 * heads * 4;
    const bool keep = m["ring_keep_blocks"].get<bool>();
    const bool queries = !keep && bundle + dq < 2 * kv;
    // This rank's chunks that travel (as keys, and as queries that attend the other rank's
    // keys: the same count at P = 2), and the other rank's chunks whose keys it attends.
    const int64_t sent = rank == 0 ? 1 : 2, attended = 3 - sent;
    const int64_t backward = keep      ? attended * kv
                             : queries ? sent * bundle + attended * dq
                                       : sent * kv + attended * kv;
    return (s / 4) * (sent * kv + backward);
  }
  ADD_FAILURE() << "no formula here for " << m["algorithm"];
  return -1;
}

// The "predicted NAME: step T s" lines of `hp-bench cp --cp-algo auto`, in printed order.
std::vector<std::pair<std::string, double>> printed_predictions(const std::string& out) {
  std::vector<std::pair<std::string, double>> got;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    char name[64];
    double step = 0;
    if (std::sscanf(line.c_str(), " predicted %63[^:]: step %lf s", name, &step) == 2) {
      got.emplace_back(name, step);
    }
  }
  return got;
}

TEST(Report, CommandsNameTheBinariesAsAReaderRunsThem) {
  using hp::bench::shown_command;
  const std::string exe = "/src/hp/build/tools/hp-bench";
  // Under the working directory: every mention of the binaries' directory becomes relative.
  EXPECT_EQ(shown_command("/src/hp/build/tools/hp-bench cp --seq 4096 --json", exe, "/src/hp"),
            "build/tools/hp-bench cp --seq 4096 --json");
  EXPECT_EQ(shown_command("/src/hp/build/tools/hp-train --trace /src/hp/build/tools/t.json", exe,
                          "/src/hp/"),
            "build/tools/hp-train --trace build/tools/t.json");
  EXPECT_EQ(shown_command("/src/hp/build/tools/hp-bench calibrate", exe, "/src/hp/build"),
            "tools/hp-bench calibrate");
  // Elsewhere, or with a relative path: as it ran.
  for (const std::string cwd : {"/src/hp/build/tools", "/src/other", "/src/hp/build/tools/x"}) {
    EXPECT_EQ(shown_command(exe + " cp --seq 4096", exe, cwd), exe + " cp --seq 4096") << cwd;
  }
  EXPECT_EQ(shown_command("build/tools/hp-bench cp", "build/tools/hp-bench", "/src/hp"),
            "build/tools/hp-bench cp");
  // A directory whose name only begins the same is not the binaries' directory.
  EXPECT_EQ(shown_command("/src/hp/build/tools2/x", exe, "/src/hp"), "/src/hp/build/tools2/x");
}

TEST(Report, CalibrateAutoAndReport) {
  const std::string dir = hp::testing::scratch_dir() + "/hp_report";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string cal = dir + "/calibration.json";
  // Without a calibration, auto names the command that makes one.
  auto missing = hp::testing::run_command(with_cache(
      cal, "cp --cp 2 --seq 512 --heads 4 --kv-heads 4 --head-dim 16 --cp-algo auto --iters 1"));
  EXPECT_NE(missing.rc, 0);
  EXPECT_NE(missing.out.find("run `hp-bench calibrate"), std::string::npos) << missing.out;

  auto c = hp::testing::run_command(with_cache(cal, "calibrate"));
  ASSERT_EQ(c.rc, 0) << c.out;
  auto calibration = json::parse(std::ifstream(cal));
  EXPECT_EQ(calibration["link"], "loopback");
  EXPECT_GT(calibration["attention_gflops"].get<double>(), 0);
  EXPECT_GT(calibration["collectives"]["all_to_all"]["2"]["seconds_per_byte"].get<double>(), 0);
  // Which line each collective took (two points, or the origin where noise flipped the sizes).
  for (const char* kind : {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"}) {
    for (const char* p : {"2", "4"}) {
      const auto how = calibration["inputs"]["comm_fit"][kind][p].get<std::string>();
      EXPECT_TRUE(how == "two_points" || how == "through_origin_and_large") << kind << p << how;
      EXPECT_GT(calibration["collectives"][kind][p]["seconds_per_byte"].get<double>(), 0) << kind;
    }
  }
  EXPECT_EQ(calibration["inputs"]["comm"].size(), 4u);  // P in {2, 4} x two sizes
  // The one-process attention rate is the median of 5 timed steps, so that one or two slow ones
  // on a shared machine do not move it: 3.5 forward units of causal S=4096, H=8, D=64 over the
  // median.
  const auto& overhead = calibration["inputs"]["overhead"];
  {
    const auto& att = calibration["inputs"]["attention"];
    auto samples = att["fwd_bwd_samples_s"].get<std::vector<double>>();
    ASSERT_EQ(samples.size(), 5u) << att;
    std::sort(samples.begin(), samples.end());
    EXPECT_DOUBLE_EQ(att["fwd_bwd_s"].get<double>(), samples[2]);
    const double fwd_flops = 2.0 * 8 * 4096.0 * 4096.0 * 64;  // causal: half of dense's 4
    const double one_process = overhead["one_process_attention_gflops"].get<double>();
    EXPECT_NEAR(one_process, 3.5 * fwd_flops / samples[2] / 1e9, 1e-9 * one_process);
  }
  // The rate the model uses is the one ranks reach, fitted with the per-token term from CP
  // layers at two lengths: the one-process rate over the fitted slowdown, and the fit
  // reproduces the residual of at least one of the runs (both, unless a term was clamped at 0).
  {
    const auto& runs = overhead["runs"];
    ASSERT_EQ(runs.size(), 2u) << overhead;
    const double x = overhead["slowdown_in_ranks"].get<double>();
    const double per_token = calibration["seconds_per_token"].get<double>();
    EXPECT_GT(x, 0) << overhead;
    EXPECT_GE(per_token, 0) << overhead;
    EXPECT_NEAR(calibration["attention_gflops"].get<double>(),
                overhead["one_process_attention_gflops"].get<double>() / x,
                1e-9 * calibration["attention_gflops"].get<double>());
    int reproduced = 0;
    for (const auto& r : runs) {
      const double residual =
          r["measured_step_s"].get<double>() - r["exposed_comm_and_projections_s"].get<double>();
      const double fitted = r["attention_at_one_process_rate_s"].get<double>() * x +
                            r["local_tokens_per_core"].get<double>() * per_token;
      if (std::abs(residual - fitted) <= 1e-9 * (1 + std::abs(residual))) ++reproduced;
    }
    EXPECT_GE(reproduced, 1) << overhead;
  }
  // The ring's attention factor (P = 2, S = 8192) and its measured waits over the model's (P = 2
  // and P = 4), from ring steps paired with Ulysses steps, recorded with their inputs: the
  // ring's compute is its paired step less its measured wait, the projections and the per-token
  // term.
  auto expect_ring_pair = [&](const json& ring, int p) {
    EXPECT_GT(ring["ulysses_over_ring_paired"].get<double>(), 0) << ring;
    EXPECT_NEAR(
        ring["ring_compute_s"].get<double>(),
        ring["ulysses_step_s"].get<double>() / ring["ulysses_over_ring_paired"].get<double>() -
            ring["ring_exposed_comm_s"].get<double>() -
            ring["projections_and_tokens_s"].get<double>(),
        1e-9);
    const double predicted = ring["ring_exposed_predicted_s"].get<double>();
    const double scale =
        predicted > 1e-3
            ? std::clamp(ring["ring_exposed_comm_s"].get<double>() / predicted, 0.1, 2.0)
            : 1.0;
    EXPECT_DOUBLE_EQ(ring["ring_exposed_scale"].get<double>(), scale) << ring;
    EXPECT_DOUBLE_EQ(calibration["ring_exposed_scale"][std::to_string(p)].get<double>(), scale);
  };
  {
    const auto& ring = calibration["inputs"]["ring_attention"];
    EXPECT_NE(ring["command"].get<std::string>().find("--cp 2 --seq 8192"), std::string::npos);
    expect_ring_pair(ring, 2);
    const double attention = ring["ring_attention_at_ulysses_rate_s"].get<double>();
    const double compute = ring["ring_compute_s"].get<double>();
    const double factor =
        attention > 0 && compute > 0 ? std::clamp(compute / attention, 0.5, 3.0) : 1.0;
    EXPECT_DOUBLE_EQ(calibration["ring_attention_factor"].get<double>(), factor) << ring;
  }
  // The ring's cost per local token per step at P = 4 (3 steps of 1024 local tokens, half a
  // core each): what its compute takes beyond its attention at the factor.
  {
    const auto& ring = calibration["inputs"]["ring_steps"];
    expect_ring_pair(ring, 4);
    const double share = std::min(1.0, calibration["cores"].get<double>() / 4.0);
    EXPECT_DOUBLE_EQ(calibration["ring_seconds_per_token_step"].get<double>(),
                     std::max(0.0, ring["beyond_s"].get<double>()) * share / (1024.0 * 3));
    EXPECT_NEAR(ring["ring_attention_s"].get<double>(),
                ring["ring_attention_at_ulysses_rate_s"].get<double>() *
                    calibration["ring_attention_factor"].get<double>(),
                1e-9);
    EXPECT_NEAR(ring["beyond_s"].get<double>(),
                ring["ring_compute_s"].get<double>() - ring["ring_attention_s"].get<double>(),
                1e-9);
  }
  // The reference step the report times again beside each grid case.
  {
    const auto& ref = calibration["inputs"]["reference_step"];
    EXPECT_EQ(ref["seq"], 2048) << ref;
    EXPECT_GT(ref["2"].get<double>(), 0) << ref;  // from the P = 2 run
    EXPECT_GT(ref["4"].get<double>(), 0) << ref;  // from the P = 4 run
  }
  // The async schedule's cost, fitted from paired sync/async steps (recorded with its inputs).
  const auto& fit = calibration["inputs"]["async_overhead"];
  EXPECT_GT(fit["sync_over_async_paired"].get<double>(), 0) << fit;
  EXPECT_GE(calibration["async_seconds_per_token"].get<double>(), 0);
  // Two ranks on this machine's cores: the lost time over the 2048 local tokens at one core.
  const double share = std::min(1.0, calibration["cores"].get<double>() / 2.0);
  EXPECT_DOUBLE_EQ(calibration["async_seconds_per_token"].get<double>(),
                   std::max(0.0, fit["lost_s"].get<double>()) * share / 2048.0);
  // Ulysses' own, from its own pairs.
  const auto& ufit = calibration["inputs"]["ulysses_async_overhead"];
  EXPECT_NE(ufit["command"].get<std::string>().find("--cp-algo ulysses"), std::string::npos)
      << ufit;
  EXPECT_GT(ufit["sync_over_async_paired"].get<double>(), 0) << ufit;
  EXPECT_DOUBLE_EQ(calibration["ulysses_async_seconds_per_token"].get<double>(),
                   std::max(0.0, ufit["lost_s"].get<double>()) * share / 2048.0);

  // auto: every legal candidate predicted (positive), the cheapest chosen, and that one runs.
  auto a = hp::testing::run_command(
      with_cache(cal,
                 "cp --cp 2 --seq 512 --heads 4 --kv-heads 4 --head-dim 16 --causal --projections "
                 "--cp-algo auto --iters 1"));
  ASSERT_EQ(a.rc, 0) << a.out;
  auto predicted = printed_predictions(a.out);
  std::set<std::string> names;
  for (const auto& [name, step] : predicted) {
    names.insert(name);
    EXPECT_GT(step, 0) << name;
  }
  EXPECT_EQ(names, (std::set<std::string>{"all_gather/sync", "all_gather/async", "ulysses/sync",
                                          "ulysses/async", "ring/sync", "ring/async",
                                          "ring(kept)/sync", "ring(kept)/async"}))
      << a.out;
  ASSERT_FALSE(predicted.empty()) << a.out;
  const auto cheapest =
      *std::min_element(predicted.begin(), predicted.end(),
                        [](const auto& x, const auto& y) { return x.second < y.second; });
  EXPECT_NE(a.out.find("  chosen: " + cheapest.first + "\n"), std::string::npos)
      << cheapest.first << "\n"
      << a.out;
  const auto slash = cheapest.first.find('/');
  EXPECT_NE(a.out.find("hp-bench cp: " + cheapest.first.substr(0, slash) + " " +
                       cheapest.first.substr(slash + 1) + " cp=2"),
            std::string::npos)
      << "the chosen configuration is the one measured\n"
      << a.out;

  auto r = hp::testing::run_command(
      with_cache(cal, "report --seqs 512 --ranks 2 --iters 1 --out " + dir + "/out"));
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = json::parse(std::ifstream(dir + "/out/results.json"));

  // The grid at P = 2, S = 512: all_gather and ring (head-tail balance; the ring also with
  // kept blocks) and ulysses, each sync and async, plus contiguous all_gather (sync) at the
  // largest S.
  const std::set<std::string> candidates{"all_gather/sync", "all_gather/async", "ulysses/sync",
                                         "ulysses/async",   "ring/sync",        "ring/async",
                                         "ring(kept)/sync", "ring(kept)/async"};
  ASSERT_EQ(j["measurements"].size(), 9u);
  std::map<std::string, json> by_name;
  double max_rel = 0, max_rel_at_speed = 0;
  std::set<double> references;  // one per run: its sync and async results share it
  for (const auto& m : j["measurements"]) {
    for (const char* key : {"name",
                            "algorithm",
                            "schedule",
                            "cp",
                            "ulysses_degree",
                            "seq",
                            "heads",
                            "kv_heads",
                            "head_dim",
                            "causal",
                            "projections",
                            "load_balance",
                            "ring_keep_blocks",
                            "link",
                            "step_time_s",
                            "exposed_comm_s",
                            "overlap_fraction",
                            "comm_bytes_per_rank",
                            "comm_bytes_theory",
                            "wire_bytes_per_rank",
                            "predicted_step_time_s",
                            "predicted_exposed_comm_s",
                            "prediction_rel_error",
                            "reference_step_s",
                            "reference_step_calibrated_s",
                            "speed_factor",
                            "predicted_compute_s",
                            "predicted_step_time_at_speed_s",
                            "prediction_rel_error_at_speed"}) {
      ASSERT_TRUE(m.contains(key)) << key << " missing in " << m.dump();
    }
    const std::string name = m["name"];
    EXPECT_TRUE(by_name.emplace(name, m).second) << "case measured twice: " << name;
    const bool contiguous = name == "all_gather(contiguous)/sync";
    EXPECT_TRUE(contiguous || candidates.count(name)) << name;
    // The name says what ran.
    EXPECT_EQ(name, m["algorithm"].get<std::string>() +
                        (m["ring_keep_blocks"].get<bool>() ? "(kept)" : "") +
                        (contiguous ? "(contiguous)" : "") + "/" +
                        m["schedule"].get<std::string>());
    EXPECT_EQ(m["load_balance"],
              (m["algorithm"] == "all_gather" || m["algorithm"] == "ring") && !contiguous)
        << name;
    EXPECT_EQ(m["ulysses_degree"], m["algorithm"] == "ulysses" ? 2 : 1) << name;
    EXPECT_EQ(m["cp"], 2);
    EXPECT_EQ(m["seq"], 512);
    EXPECT_EQ(m["link"], "loopback");
    EXPECT_EQ(m["causal"], true);
    EXPECT_EQ(m["projections"], true);
    const double meas = m["step_time_s"], pred = m["predicted_step_time_s"];
    EXPECT_GT(meas, 0) << name;
    EXPECT_GT(pred, 0) << name;
    EXPECT_GE(m["exposed_comm_s"].get<double>(), 0) << name;
    EXPECT_GE(m["predicted_exposed_comm_s"].get<double>(), 0) << name;
    EXPECT_NEAR(m["prediction_rel_error"].get<double>(), std::abs(pred - meas) / meas, 1e-9)
        << name;
    if (!contiguous) max_rel = std::max(max_rel, m["prediction_rel_error"].get<double>());
    // At the machine's speed during the run: its reference step over the calibration's at
    // P = 2 scales the predicted compute; the exposed communication stays.
    EXPECT_GT(m["reference_step_s"].get<double>(), 0) << name;
    references.insert(m["reference_step_s"].get<double>());
    EXPECT_DOUBLE_EQ(m["reference_step_calibrated_s"].get<double>(),
                     calibration["inputs"]["reference_step"]["2"].get<double>());
    const double factor =
        m["reference_step_s"].get<double>() / m["reference_step_calibrated_s"].get<double>();
    EXPECT_NEAR(m["speed_factor"].get<double>(), factor, 1e-12 * factor) << name;
    EXPECT_NEAR(
        pred, m["predicted_compute_s"].get<double>() + m["predicted_exposed_comm_s"].get<double>(),
        1e-12 * pred)
        << name;
    const double at_speed = m["predicted_compute_s"].get<double>() * factor +
                            m["predicted_exposed_comm_s"].get<double>();
    EXPECT_NEAR(m["predicted_step_time_at_speed_s"].get<double>(), at_speed, 1e-12 * at_speed)
        << name;
    EXPECT_NEAR(m["prediction_rel_error_at_speed"].get<double>(), std::abs(at_speed - meas) / meas,
                1e-9)
        << name;
    if (!contiguous) {
      max_rel_at_speed =
          std::max(max_rel_at_speed, m["prediction_rel_error_at_speed"].get<double>());
    }
    // Bytes: counted by the comm layer on every rank = the formula, computed here and by the
    // bench; the scalars are the busiest rank's.
    const std::vector<int64_t> by_rank = {cp_layer_bytes(m, 0), cp_layer_bytes(m, 1)};
    EXPECT_EQ(m["comm_bytes_by_rank"].get<std::vector<int64_t>>(), by_rank) << name;
    EXPECT_EQ(m["comm_bytes_theory_by_rank"].get<std::vector<int64_t>>(), by_rank) << name;
    EXPECT_EQ(m["comm_bytes_per_rank"].get<int64_t>(), std::max(by_rank[0], by_rank[1])) << name;
    EXPECT_EQ(m["comm_bytes_theory"].get<int64_t>(), std::max(by_rank[0], by_rank[1])) << name;
    EXPECT_EQ(m["wire_bytes_per_rank"].get<int64_t>(), -1) << name << ": no emulated link";
  }
  std::set<std::string> measured;
  for (const auto& [name, m] : by_name)
    measured.insert(name);
  std::set<std::string> grid = candidates;
  grid.insert("all_gather(contiguous)/sync");
  EXPECT_EQ(measured, grid);
  EXPECT_DOUBLE_EQ(j["cost_model"]["max_rel_error"].get<double>(), max_rel);
  EXPECT_DOUBLE_EQ(j["cost_model"]["max_rel_error_at_speed"].get<double>(), max_rel_at_speed);
  EXPECT_EQ(references.size(), 5u);  // five runs (five distinct timings)

  // auto: predictions for exactly the candidates, ascending; the choice is the cheapest
  // prediction, its time is its measurement, the best is the fastest measured candidate.
  ASSERT_EQ(j["auto_selection"].size(), 1u);
  const auto& sel = j["auto_selection"][0];
  EXPECT_EQ(sel["case"], (json{{"link", "loopback"}, {"cp", 2}, {"seq", 512}, {"causal", true}}));
  std::set<std::string> predicted_names;
  double previous = 0;
  for (const auto& p : sel["predictions"]) {
    predicted_names.insert(p["choice"].get<std::string>());
    const double t = p["predicted_step_time_s"];
    EXPECT_GT(t, 0) << p.dump();
    EXPECT_GE(t, previous) << "predictions are ranked, cheapest first";
    previous = t;
  }
  EXPECT_EQ(predicted_names, candidates);
  const std::string choice = sel["auto_choice"];
  EXPECT_EQ(choice, sel["predictions"][0]["choice"]);
  ASSERT_TRUE(candidates.count(choice)) << choice;
  EXPECT_EQ(sel["auto_step_time_s"].get<double>(), by_name[choice]["step_time_s"].get<double>());
  std::string best;
  for (const auto& n : candidates) {
    if (best.empty() ||
        by_name[n]["step_time_s"].get<double>() < by_name[best]["step_time_s"].get<double>()) {
      best = n;
    }
  }
  EXPECT_EQ(sel["best_choice"], best);
  EXPECT_EQ(sel["best_step_time_s"].get<double>(), by_name[best]["step_time_s"].get<double>());
  EXPECT_NEAR(sel["auto_over_best"].get<double>(),
              sel["auto_step_time_s"].get<double>() / sel["best_step_time_s"].get<double>(), 1e-12);
  EXPECT_GE(sel["auto_over_best"].get<double>(), 1.0);

  // The rest of what the report claims to hold.
  EXPECT_EQ(j["calibrations"]["loopback"]["link"], "loopback");
  EXPECT_EQ(j["attention"].size(), 1u);  // one per S
  EXPECT_TRUE(j["hsdp"].contains("results")) << j["hsdp"].dump();
  EXPECT_GT(j["wall_s"].get<double>(), 0);
  int cp_commands = 0;
  for (const auto& cmd : j["commands"])
    cp_commands += cmd.get<std::string>().find(" cp --seq 512 ") != std::string::npos;
  // balanced all_gather, ulysses, ring, ring with kept blocks (each sync + async), contiguous
  EXPECT_EQ(cp_commands, 5);

  // results.md: a row per measurement with its numbers, the cost model line, the auto row.
  const std::string md = read_file(dir + "/out/results.md");
  for (const auto& [name, m] : by_name) {
    const std::string row = "| loopback | 2 | 512 | " + name + " | " + fixed(m["step_time_s"], 3) +
                            " | " + fixed(m["predicted_step_time_s"], 3) + " | " +
                            fixed(m["prediction_rel_error"], 2) + " | ";
    EXPECT_NE(md.find(row), std::string::npos) << row << "\n" << md;
  }
  EXPECT_NE(md.find("Cost model: max relative error " + fixed(max_rel, 2) + " over the grid; "),
            std::string::npos)
      << md;
  EXPECT_NE(md.find(fixed(max_rel_at_speed, 2) + ".\n\n## --cp-algo auto"), std::string::npos)
      << md;
  const std::string auto_row = "| loopback P=2 S=512 | " + choice + " | " +
                               fixed(sel["auto_step_time_s"], 3) + " | " + best + " | ";
  EXPECT_NE(md.find(auto_row), std::string::npos) << auto_row << "\n" << md;
  for (const char* img : {"![chart](chart.svg)", "![per-rank timeline](timeline.svg)"})
    EXPECT_NE(md.find(img), std::string::npos) << img;

  // chart.svg: well-formed; one titled bar per measurement, named in the legend.
  std::unique_ptr<hp::testing::XmlElement> chart;
  try {
    chart = hp::testing::parse_xml(read_file(dir + "/out/chart.svg"));
  } catch (const std::exception& e) {
    FAIL() << "chart.svg: " << e.what();
  }
  EXPECT_EQ(chart->name, "svg");
  EXPECT_EQ(chart->attrs["xmlns"], "http://www.w3.org/2000/svg");
  std::multiset<std::string> bars;
  for (const auto* rect : chart->find_all("rect")) {
    if (const auto* title = rect->child("title")) {
      bars.insert(title->text.substr(0, title->text.find(':')));
      EXPECT_GT(std::stod(rect->attrs.at("height")), 0) << title->text;
    }
  }
  EXPECT_EQ(bars, (std::multiset<std::string>(measured.begin(), measured.end())));
  std::set<std::string> texts;
  for (const auto* t : chart->find_all("text"))
    texts.insert(t->text);
  for (const auto& name : measured)
    EXPECT_TRUE(texts.count(name)) << "legend entry " << name;
  EXPECT_TRUE(texts.count("exposed communication"));
  EXPECT_TRUE(texts.count("P=2 S=512 loopback"));

  // timeline.svg: well-formed; a track per rank, with collectives, waits and attention (forward
  // and backward) on both.
  std::unique_ptr<hp::testing::XmlElement> timeline;
  try {
    timeline = hp::testing::parse_xml(read_file(dir + "/out/timeline.svg"));
  } catch (const std::exception& e) {
    FAIL() << "timeline.svg: " << e.what();
  }
  EXPECT_EQ(timeline->name, "svg");
  texts.clear();
  for (const auto* t : timeline->find_all("text"))
    texts.insert(t->text);
  EXPECT_TRUE(texts.count("rank 0") && texts.count("rank 1") && !texts.count("rank 2"));
  EXPECT_TRUE(texts.count("attention (forward or backward)"));
  // Track r spans y in [40 + 34r, 40 + 34(r + 1)) (svg.cpp's layout).
  std::map<int, std::vector<std::string>> titles;  // "NAME GROUP T ms"
  for (const auto* rect : timeline->find_all("rect")) {
    const auto* title = rect->child("title");
    if (title == nullptr) continue;
    titles[static_cast<int>((std::stod(rect->attrs.at("y")) - 40) / 34)].push_back(title->text);
  }
  EXPECT_EQ(titles.size(), 2u);
  for (int rank : {0, 1}) {
    for (const std::string prefix :
         {"all_gather cp ", "wait all_gather cp ", "attention  ", "attention_backward  "}) {
      EXPECT_TRUE(std::any_of(titles[rank].begin(), titles[rank].end(),
                              [&](const std::string& t) { return t.rfind(prefix, 0) == 0; }))
          << "rank " << rank << " has no '" << prefix << "' event";
    }
  }
}

}  // namespace
