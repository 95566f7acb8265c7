#include "hp/bench/report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "hp/bench/calibrate.h"
#include "hp/bench/link.h"
#include "hp/bench/svg.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "hp/plan/cost_model.h"

namespace hp::bench {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string link_flag(const std::string& link) {
  return link == "loopback" ? "" : " --link-rate " + link;
}

void progress(const std::string& what, std::chrono::steady_clock::time_point t0) {
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("hp-bench report [%6.0f s] %s\n", s, what.c_str());
  std::fflush(stdout);
}

struct Choice {
  std::string algo;
  int64_t degree = 0;
  bool load_balance = false;
  bool keep_blocks = false;  // ring: --ring-keep-blocks
};

plan::CPWorkload workload(const ReportOptions& o, int64_t s, int64_t p, bool load_balance) {
  plan::CPWorkload w;  // causal, with projections (the defaults), as the grid runs
  w.seq = s;
  w.heads = o.heads;
  w.kv_heads = o.kv_heads;
  w.head_dim = o.head_dim;
  w.load_balance = load_balance;
  w.ranks_on_node = static_cast<int>(p);
  return w;
}

std::string fixed(double v, int digits = 3) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// A results.md cell: m[key] with `digits` decimals, "-" where the measurement has no such field.
std::string cell(const json& m, const char* key, int digits = 3) {
  return m.contains(key) ? fixed(m[key], digits) : "-";
}

// The cost model's names (plan::predict_cp_step), and "(contiguous)" for unbalanced all_gather.
std::string choice_name(const std::string& algo, int64_t u, const std::string& schedule,
                        bool contiguous_ag, bool keep_blocks) {
  std::string n = algo;
  if (algo == "hybrid" || algo == "usp") n += "(U=" + std::to_string(u) + ")";
  if (keep_blocks) n += "(kept)";
  if (contiguous_ag) n += "(contiguous)";
  return n + "/" + schedule;
}

// Every grid point must run every strategy of the grid: checked before the calibration starts
// (a child's refusal deep into the run would lose what was measured before it).
void check_grid(const ReportOptions& o) {
  HP_CHECK(!o.ranks.empty() && !o.seqs.empty(),
           "hp-bench report: --ranks and --seqs need at least "
           "one value each (e.g. --ranks 2 4 --seqs 4096 16384)");
  HP_CHECK(o.iters_small >= 1 && o.iters_small <= 1000, "hp-bench report: --iters ", o.iters_small,
           " must be in [1, 1000]");
  for (const int64_t p : o.ranks) {
    HP_CHECK(p >= 2 && p <= 64 && (p < 4 || p % 2 == 0) && o.heads % p == 0 && o.kv_heads % p == 0,
             "hp-bench report: --ranks ", p, " cannot run the whole grid: P must be in [2, 64], ",
             "even from 4 (hybrid and usp run with Ulysses degree 2), and divide the ", o.heads,
             " heads and ", o.kv_heads, " key/value heads (ulysses); e.g. --ranks 2 4");
    for (const int64_t s : o.seqs) {
      HP_CHECK(s >= 2 * p && s % (2 * p) == 0, "hp-bench report: --seqs ", s,
               " is not a multiple of 2 x P = ", 2 * p,
               " (head-tail load balance splits the sequence into 2P chunks at --ranks ", p,
               "); e.g. --seqs 4096 16384");
    }
  }
}

}  // namespace

std::string run_report(const ReportOptions& o) {
  HP_CHECK(!o.links.empty(), "hp-bench report: no link given");
  check_grid(o);
  const auto t0 = std::chrono::steady_clock::now();
  fs::create_directories(o.out_dir);
  const int cores = common::available_cores();
  json results;
  results["machine"] = {{"cores", cores},
                        {"note",
                         "ranks share the machine's cores: P = 2 gives each rank one "
                         "core, P = 4 half a core (per-rank figures then mean less "
                         "than totals)"}};
  results["commands"] = json::array();
  // Says what runs next and lists it among the report's commands, as a reader runs it.
  auto record = [&](const std::string& cmd) {
    const std::string shown = shown_command(cmd, o.self_exe);
    progress(shown, t0);
    results["commands"].push_back(shown);
  };
  results["measurements"] = json::array();
  results["auto_selection"] = json::array();
  double max_rel = 0, max_rel_at_speed = 0;
  std::vector<BarGroup> groups;
  const int64_t s_max = *std::max_element(o.seqs.begin(), o.seqs.end());
  auto run_cp = [&](const std::string& link, int64_t p, int64_t s, const Choice& c,
                    const std::string& schedule, const plan::Calibration* cal) {
    const int iters = s >= 16384 ? o.iters_large : o.iters_small;
    std::string cmd = common::str_cat(
        o.self_exe, " cp --seq ", s, " --heads ", o.heads, " --kv-heads ", o.kv_heads,
        " --head-dim ", o.head_dim, " --cp ", p, " --cp-algo ", c.algo, " --schedule ", schedule,
        " --projections --causal --iters ", iters, c.load_balance ? " --load-balance" : "",
        c.keep_blocks ? " --ring-keep-blocks" : "",
        c.degree > 0 ? common::str_cat(" --ulysses-degree ", c.degree) : std::string(),
        cal != nullptr ? " --reference-step" : "", link_flag(link), o.child_flags, " --json");
    record(cmd);
    auto j = json::parse(run_for_json(cmd));
    const double reference_cal = cal != nullptr ? calibrated_reference_step_s(*cal, p) : -1;
    std::vector<json> out;
    for (auto& m : j["results"]) {
      const std::string sched = m["schedule"];
      const bool contiguous = c.algo == "all_gather" && !c.load_balance;
      m["name"] = choice_name(c.algo, m["ulysses_degree"], sched, contiguous, c.keep_blocks);
      m["link"] = link;
      m["threads_per_rank"] = m["threads_per_rank"];
      m["cores_per_rank"] = std::min(1.0, static_cast<double>(cores) / static_cast<double>(p));
      // Every rank's bytes cross the one emulated link (a loopback shaped to the rate), so it is
      // busy P x the bytes per rank over the rate each step; what the waits did not expose of
      // that was hidden behind compute (in either schedule: the ring hides in both).
      if (link != "loopback" && m["wire_bytes_per_rank"].get<int64_t>() >= 0) {
        const double busy = 8.0 * m["wire_bytes_per_rank"].get<double>() * static_cast<double>(p) /
                            static_cast<double>(parse_link_rate(link));
        m["link_busy_s"] = busy;
        m["hidden_of_link_time"] =
            busy > 0 ? std::max(0.0, 1.0 - m["exposed_comm_s"].get<double>() / busy) : 0.0;
      }
      if (cal != nullptr) {
        cp::ContextParallelConfig cfg;
        cfg.algorithm = cp::parse_algorithm(c.algo);
        cfg.schedule = cp::parse_schedule(sched);
        if (c.degree > 0) cfg.ulysses_degree = c.degree;
        cfg.load_balance = c.load_balance;
        cfg.ring_keep_blocks = c.keep_blocks;
        auto pred = plan::predict_cp_step(*cal, *cp::normalize(cfg, p), p,
                                          workload(o, s, p, c.load_balance));
        const double meas = m["step_time_s"];
        const double rel = std::abs(pred.step_s - meas) / meas;
        m["predicted_step_time_s"] = pred.step_s;
        m["predicted_exposed_comm_s"] = pred.exposed_comm_s;
        m["prediction_rel_error"] = rel;
        if (!contiguous) max_rel = std::max(max_rel, rel);
        if (reference_cal > 0) {
          const double factor = m["reference_step_s"].get<double>() / reference_cal;
          const double at_speed = pred.compute_s * factor + pred.exposed_comm_s;
          const double rel_at_speed = std::abs(at_speed - meas) / meas;
          m["reference_step_calibrated_s"] = reference_cal;
          m["speed_factor"] = factor;
          m["predicted_compute_s"] = pred.compute_s;
          m["predicted_step_time_at_speed_s"] = at_speed;
          m["prediction_rel_error_at_speed"] = rel_at_speed;
          if (!contiguous) max_rel_at_speed = std::max(max_rel_at_speed, rel_at_speed);
        }
      }
      results["measurements"].push_back(m);
      out.push_back(m);
    }
    return out;
  };

  for (size_t li = 0; li < o.links.size(); ++li) {
    const std::string& link = o.links[li];
    const auto cal_path = plan::default_calibration_path(link);
    bool calibrate = o.recalibrate || !fs::exists(cal_path);
    if (!calibrate && calibrated_reference_step_s(plan::load_calibration(cal_path), 2) <= 0) {
      progress("the cached " + cal_path + " has no reference step: recalibrating", t0);
      calibrate = true;
    }
    if (calibrate) {
      const std::string cmd = o.self_exe + " calibrate" + link_flag(link) + o.child_flags;
      record(cmd);
      HP_CHECK(std::system(cmd.c_str()) == 0, "hp-bench report: calibration failed: ", cmd);
    }
    const auto cal = plan::load_calibration(cal_path);
    results["calibrations"][link] = json::parse(plan::to_json(cal));
    for (int64_t p : o.ranks) {
      for (int64_t s : o.seqs) {
        std::vector<Choice> choices{{"all_gather", 0, true},
                                    {"ulysses", 0, false},
                                    {"ring", 0, true},
                                    {"ring", 0, true, true}};
        if (p >= 4) {
          choices.push_back({"hybrid", 2, true});
          choices.push_back({"usp", 2, true});
        }
        BarGroup g;
        g.title = common::str_cat("P=", p, " S=", s, " ", link);
        std::map<std::string, double> measured;
        for (const auto& c : choices) {
          for (const auto& m : run_cp(link, p, s, c, "async", &cal)) {
            measured[m["name"]] = m["step_time_s"];
            g.bars.push_back({m["name"], m["step_time_s"], m["exposed_comm_s"]});
          }
        }
        if (p == 2 && s == s_max) {  // head-tail balance against contiguous all_gather
          for (const auto& m : run_cp(link, p, s, {"all_gather", 0, false}, "sync", &cal)) {
            g.bars.push_back({m["name"], m["step_time_s"], m["exposed_comm_s"]});
          }
        }
        groups.push_back(g);
        const auto ranked = plan::rank_cp_configs(cal, p, workload(o, s, p, true));
        json predictions = json::array();
        for (const auto& r : ranked)
          predictions.push_back({{"choice", r.name}, {"predicted_step_time_s", r.step_s}});
        auto best =
            std::min_element(measured.begin(), measured.end(),
                             [](const auto& a, const auto& b) { return a.second < b.second; });
        const auto& auto_name = ranked.front().name;
        const double auto_time = measured.count(auto_name) ? measured[auto_name] : -1;
        results["auto_selection"].push_back(
            {{"case", {{"link", link}, {"cp", p}, {"seq", s}, {"causal", true}}},
             {"auto_choice", auto_name},
             {"auto_step_time_s", auto_time},
             {"best_choice", best->first},
             {"best_step_time_s", best->second},
             {"auto_over_best", auto_time > 0 ? auto_time / best->second : -1},
             {"predictions", predictions}});
      }
    }
  }
  results["cost_model"] = {
      {"max_rel_error", max_rel},
      {"max_rel_error_at_speed", max_rel_at_speed},
      {"over", "every grid measurement (contiguous all_gather excluded)"},
      {"at_speed",
       "the prediction with its compute scaled by the measurement's speed_factor (the reference "
       "step timed in its run over the calibration's at the same P)"}};
  // The honest contrast: the same async cases on plain loopback.
  if (std::find(o.links.begin(), o.links.end(), "loopback") == o.links.end()) {
    BarGroup g;
    g.title = common::str_cat("P=2 S=", s_max, " loopback");
    for (const auto& c : {Choice{"all_gather", 0, true}, Choice{"ulysses", 0, false}}) {
      for (const auto& m : run_cp("loopback", 2, s_max, c, "async", nullptr)) {
        g.bars.push_back({m["name"], m["step_time_s"], m["exposed_comm_s"]});
      }
    }
    groups.push_back(g);
  }
  if (o.with_attention) {
    for (int64_t s : o.seqs) {
      const std::string cmd =
          common::str_cat(o.self_exe, " attention --seq ", s, " --heads ", o.heads, " --kv-heads ",
                          o.kv_heads, " --head-dim ", o.head_dim,
                          " --causal --primitive blockwise --iters 1", o.child_flags, " --json");
      record(cmd);
      results["attention"].push_back(json::parse(run_for_json(cmd)));
    }
  }
  if (o.with_hsdp) {
    const std::string cmd = o.self_exe +
                            " hsdp --nproc 4 --dp-shard 2 --dp-replicate 2 --iters 3 --json" +
                            link_flag(o.links.front()) + o.child_flags;
    record(cmd);
    results["hsdp"] = json::parse(run_for_json(cmd));
  }
  const std::string chart = (fs::path(o.out_dir) / "chart.svg").string();
  std::ofstream(chart) << bar_chart_svg(
      "CP layer step (forward + backward, causal, projections): step time, exposed "
      "communication shaded",
      groups);
  if (!o.train_exe.empty()) {
    const std::string trace = (fs::path(o.out_dir) / "timeline_trace.json").string();
    const std::string cmd = o.train_exe +
                            " --nproc 2 --cp 2 --cp-algo all_gather --schedule async --steps 3 "
                            "--seq-len 4096 --trace " +
                            trace + o.child_flags;
    record(cmd);
    HP_CHECK(std::system((cmd + " > /dev/null").c_str()) == 0, "hp-bench report: failed: ", cmd);
    auto events = common::read_chrome_trace(trace);
    int64_t lo = INT64_MAX, hi = 0;
    for (const auto& e : events) {
      lo = std::min(lo, e.begin_us);
      hi = std::max(hi, e.end_us);
    }
    // The last third (the final step, past start-up), widened where needed so that it holds
    // every rank's last collective and last wait: on a busy machine one rank's final step can
    // start well before the others' end.
    int64_t from = hi - (hi - lo) / 3;
    std::map<std::pair<int, std::string>, int64_t> last_begin;
    for (const auto& e : events) {
      if (e.category != "comm" && e.category != "comm_wait") continue;
      auto& b = last_begin[{e.rank, e.category}];
      b = std::max(b, e.begin_us);
    }
    for (const auto& [key, begin] : last_begin)
      from = std::min(from, begin);
    std::ofstream((fs::path(o.out_dir) / "timeline.svg").string()) << timeline_svg(
        "hp-train --nproc 2 --cp 2 all_gather async, S=4096 (last step; "
        "loopback)",
        events, from, hi);
    fs::remove(trace);
  }
  results["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string path = (fs::path(o.out_dir) / "results.json").string();
  std::ofstream(path) << results.dump(2) << "\n";
  // Markdown table.
  std::ofstream md((fs::path(o.out_dir) / "results.md").string());
  md << "# CP benchmark report\n\nGenerated by `hp-bench report`; every command is listed in "
        "results.json. Causal attention with Q/K/V/O projections, H = "
     << o.heads << ", H_kv = " << o.kv_heads << ", D = " << o.head_dim << ", fp32. " << cores
     << " cores: P = 2 gives each rank one core, P = 4 half a core.\n\n"
     << "![chart](chart.svg)\n\n| link | P | S | choice | step s | predicted s | rel. error | "
        "speed factor | at that speed: predicted s | rel. error | exposed comm s | hidden by "
        "async | link busy s | hidden of link time | comm bytes, busiest rank | on the wire/rank, "
        "mean |\n"
     << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& m : results["measurements"]) {
    const int64_t wire = m["wire_bytes_per_rank"];
    md << "| " << m["link"].get<std::string>() << " | " << m["cp"] << " | " << m["seq"] << " | "
       << m["name"].get<std::string>() << " | " << fixed(m["step_time_s"]) << " | "
       << cell(m, "predicted_step_time_s") << " | " << cell(m, "prediction_rel_error", 2) << " | "
       << cell(m, "speed_factor", 2) << " | " << cell(m, "predicted_step_time_at_speed_s") << " | "
       << cell(m, "prediction_rel_error_at_speed", 2) << " | " << fixed(m["exposed_comm_s"])
       << " | " << (m["schedule"] == "async" ? fixed(m["overlap_fraction"], 2) : "-") << " | "
       << cell(m, "link_busy_s") << " | " << cell(m, "hidden_of_link_time", 2) << " | "
       << m["comm_bytes_per_rank"] << " | " << (wire >= 0 ? std::to_string(wire) : "-") << " |\n";
  }
  md << "\nHidden by async: 1 - exposed async / exposed sync of the same choice (the ring hides in "
        "both schedules, so 0 there). Link busy: every rank's bytes cross the one emulated link, "
        "so it is busy P x the bytes on the wire per rank / the rate each step; hidden of link "
        "time: 1 - exposed / link busy. Comm bytes: what the busiest rank handed to the transport "
        "in one step (a causal ring's ranks differ); on the wire: what crossed the emulated link "
        "per step / P.\n";
  md << "\nCost model: max relative error " << fixed(max_rel, 2)
     << " over the grid; at the machine's speed during each run (speed factor: the reference "
        "step timed in the run over the calibration's at the same P; the prediction's compute "
        "scaled by it) "
     << fixed(max_rel_at_speed, 2) << ".\n\n## --cp-algo auto\n\n"
     << "| case | auto choice | its step s | best measured | best s | auto / best |\n"
        "|---|---|---|---|---|---|\n";
  for (const auto& a : results["auto_selection"]) {
    md << "| " << a["case"]["link"].get<std::string>() << " P=" << a["case"]["cp"]
       << " S=" << a["case"]["seq"] << " | " << a["auto_choice"].get<std::string>() << " | "
       << fixed(a["auto_step_time_s"]) << " | " << a["best_choice"].get<std::string>() << " | "
       << fixed(a["best_step_time_s"]) << " | " << fixed(a["auto_over_best"], 2) << " |\n";
  }
  if (!o.train_exe.empty()) md << "\n![per-rank timeline](timeline.svg)\n";
  progress("wrote " + path, t0);
  return path;
}

}  // namespace hp::bench
