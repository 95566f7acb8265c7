#include "hp/plan/cost_model.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "hp/common/check.h"
#include "hp/cp/strategy.h"

namespace hp::plan {
namespace fs = std::filesystem;

namespace {

// The entry for this world size, else the nearest measured one (of two as near, the smaller);
// nullptr where there is none.
template <class T>
const T* nearest_world_size(const std::map<int64_t, T>& by_p, int64_t world_size) {
  const T* best = nullptr;
  int64_t best_gap = 0;
  for (const auto& [p, value] : by_p) {
    const int64_t gap = std::llabs(p - world_size);
    if (best == nullptr || gap < best_gap) {
      best = &value;
      best_gap = gap;
    }
  }
  return best;
}

}  // namespace

const CollectiveFit& Calibration::fit(const std::string& kind, int64_t world_size) const {
  auto it = collectives.find(kind);
  HP_CHECK(it != collectives.end() && !it->second.empty(), "cost model: the calibration for link '",
           link, "' has no '", kind, "' measurements; rerun hp-bench calibrate");
  return *nearest_world_size(it->second, world_size);
}

double Calibration::ring_exposed_scale_at(int64_t ring_size) const {
  const double* scale = nearest_world_size(ring_exposed_scale, ring_size);
  return scale != nullptr ? *scale : 1.0;
}

CollectiveFit fit_collective_line(double small_bytes, double small_s, double large_bytes,
                                  double large_s, bool* through_origin) {
  HP_CHECK(large_bytes > small_bytes && small_bytes > 0,
           "fit_collective_line: the sizes must be 0 < small < large (got small_bytes ",
           small_bytes, ", large_bytes ", large_bytes, "); time two different positive sizes");
  const double slope = (large_s - small_s) / (large_bytes - small_bytes);
  const bool origin = !(slope > 0);
  if (through_origin != nullptr) *through_origin = origin;
  if (origin) return {0.0, std::max(0.0, large_s) / large_bytes};
  return {std::max(0.0, small_s - slope * small_bytes), slope};
}

std::string to_json(const Calibration& c) {
  nlohmann::json j;
  j["link"] = c.link;
  j["cores"] = c.cores;
  j["attention_gflops"] = c.attention_gflops;
  j["matmul_gflops"] = c.matmul_gflops;
  j["overlap_budget"] = c.overlap_budget;
  j["seconds_per_token"] = c.seconds_per_token;
  j["async_seconds_per_token"] = c.async_seconds_per_token;
  j["ulysses_async_seconds_per_token"] = c.ulysses_async_seconds_per_token;
  j["ring_seconds_per_token_step"] = c.ring_seconds_per_token_step;
  j["ring_attention_factor"] = c.ring_attention_factor;
  for (const auto& [p, scale] : c.ring_exposed_scale)
    j["ring_exposed_scale"][std::to_string(p)] = scale;
  for (const auto& [kind, by_p] : c.collectives) {
    for (const auto& [p, f] : by_p) {
      j["collectives"][kind][std::to_string(p)] = {{"latency_s", f.latency_s},
                                                   {"seconds_per_byte", f.seconds_per_byte}};
    }
  }
  j["inputs"] = nlohmann::json::parse(c.inputs_json);
  return j.dump(2);
}

Calibration calibration_from_json(const std::string& text) {
  auto j = nlohmann::json::parse(text);
  Calibration c;
  c.link = j.at("link");
  c.cores = j.at("cores");
  c.attention_gflops = j.at("attention_gflops");
  c.matmul_gflops = j.at("matmul_gflops");
  c.overlap_budget = j.value("overlap_budget", 0.5);
  c.seconds_per_token = j.value("seconds_per_token", 0.0);
  c.async_seconds_per_token = j.value("async_seconds_per_token", 0.0);
  c.ulysses_async_seconds_per_token =
      j.value("ulysses_async_seconds_per_token", c.async_seconds_per_token);
  c.ring_seconds_per_token_step = j.value("ring_seconds_per_token_step", 0.0);
  c.ring_attention_factor = j.value("ring_attention_factor", 1.0);
  if (j.contains("ring_exposed_scale")) {
    for (const auto& [p, scale] : j["ring_exposed_scale"].items())
      c.ring_exposed_scale[std::stoll(p)] = scale.get<double>();
  }
  for (const auto& [kind, by_p] : j.at("collectives").items()) {
    for (const auto& [p, f] : by_p.items()) {
      c.collectives[kind][std::stoll(p)] = {f.at("latency_s"), f.at("seconds_per_byte")};
    }
  }
  c.inputs_json = j.value("inputs", nlohmann::json::object()).dump();
  return c;
}

void save_calibration(const std::string& path, const Calibration& c) {
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << to_json(c) << "\n";
  fs::rename(tmp, path);
}

Calibration load_calibration(const std::string& path) {
  std::ifstream f(path);
  HP_CHECK(f.good(), "cost model: no calibration at '", path,
           "'; run `hp-bench calibrate [--link-rate RATE]` once on this machine and link (or "
           "set HP_CALIBRATION to a calibration file)");
  std::string text((std::istreambuf_iterator<char>(f)), {});
  try {
    return calibration_from_json(text);
  } catch (const nlohmann::json::exception& e) {
    HP_CHECK(false, "cost model: '", path, "' is not a calibration file (", e.what(),
             "); rerun hp-bench calibrate");
  }
  return {};
}

std::string current_link() {
  const char* v = std::getenv(kLinkRateEnv);
  return v != nullptr && *v != '\0' ? std::string(v) : std::string("loopback");
}

std::string default_calibration_path(const std::string& link) {
  if (const char* env = std::getenv("HP_CALIBRATION"); env != nullptr && *env != '\0') return env;
  std::string base;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    base = x;
  } else if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    base = std::string(h) + "/.cache";
  } else {
    base = "/tmp";
  }
  return base + "/hyperparallel/calibration-" + link + ".json";
}

std::vector<cp::ContextParallelConfig> legal_cp_configs(int64_t p, const CPWorkload& w) {
  std::vector<cp::ContextParallelConfig> out;
  auto add = [&](cp::CPAlgorithm a, std::optional<int64_t> u, bool keep_blocks = false) {
    for (auto s : {cp::CPSchedule::kSync, cp::CPSchedule::kAsync}) {
      cp::ContextParallelConfig c;
      c.algorithm = a;
      c.ring_keep_blocks = keep_blocks;
      c.ulysses_degree = u;
      // Only where the candidate repeats (all_gather and ring move every K/V head whole).
      if (a != cp::CPAlgorithm::kAllGather && a != cp::CPAlgorithm::kRing &&
          cp::repeats_kv(w.kv_head_policy, cp::ulysses_degree_of(c, p), w.kv_heads)) {
        c.kv_head_policy = w.kv_head_policy;
      }
      c.schedule = s;
      // Every strategy that has head-tail balance gets it (ulysses needs none).
      c.load_balance = w.load_balance && a != cp::CPAlgorithm::kUlysses;
      // All but all_gather balance data-order shards only.
      if (a != cp::CPAlgorithm::kAllGather) c.load_balance_form = cp::LoadBalanceForm::kDataOrder;
      try {  // the same checks the planner runs
        auto n = cp::normalize(c, p);
        if (!n) continue;
        cp::check_heads(*n, p, w.heads, w.kv_heads);
        cp::check_sequence(*n, p, w.seq);
        out.push_back(*n);
      } catch (const hp::Error&) {
      }
    }
  };
  if (p < 2) return out;
  add(cp::CPAlgorithm::kAllGather, std::nullopt);
  add(cp::CPAlgorithm::kUlysses, std::nullopt);
  for (bool keep : {false, true})
    add(cp::CPAlgorithm::kRing, std::nullopt, keep);
  for (int64_t u = 2; u < p; ++u) {
    if (p % u == 0) {
      add(cp::CPAlgorithm::kHybrid, u);
      add(cp::CPAlgorithm::kUsp, u);
    }
  }
  return out;
}

namespace {

// Share of the full problem's attention work on the slowest rank.
double attention_share(int64_t p, int64_t u, bool causal, bool balanced) {
  const double c = static_cast<double>(p / u);
  const double per_ulysses = 1.0 / static_cast<double>(u);
  if (!causal || balanced || c == 1) return per_ulysses / c;
  return per_ulysses * (2 * c - 1) / (c * c);  // the last contiguous chunk sees every key
}

}  // namespace

CPPrediction predict_cp_step(const Calibration& cal, const cp::ContextParallelConfig& config,
                             int64_t p, const CPWorkload& w) {
  CPPrediction out;
  out.config = config;
  const int64_t u = cp::ulysses_degree_of(config, p), c = p / u;
  const bool async = config.schedule == cp::CPSchedule::kAsync;
  const bool ring =
      config.algorithm == cp::CPAlgorithm::kRing || config.algorithm == cp::CPAlgorithm::kUsp;
  const bool grouped =
      config.algorithm == cp::CPAlgorithm::kHybrid || config.algorithm == cp::CPAlgorithm::kUsp;
  out.name = cp::to_string(config.algorithm) + (grouped ? "(U=" + std::to_string(u) + ")" : "") +
             (config.ring_keep_blocks ? "(kept)" : "") + "/" + cp::to_string(config.schedule);
  const int ranks = w.ranks_on_node > 0 ? w.ranks_on_node : static_cast<int>(p);
  const double share = std::min(1.0, static_cast<double>(cal.cores) / ranks);
  const double s = static_cast<double>(w.seq), b = static_cast<double>(w.batch);
  const double h = static_cast<double>(w.heads * w.head_dim);
  const double hkv = static_cast<double>(w.kv_heads * w.head_dim);
  // What the collectives move of K/V: on the repeat path each Ulysses rank receives the one
  // head it reads, as if there were U heads (cp/volume.h); the head groups then split the
  // query heads alone (usp: one group).
  const bool repeat = cp::repeats_kv(config.kv_head_policy, u, w.kv_heads);
  const double hkv_moved = repeat ? static_cast<double>(u * w.head_dim) : hkv;
  const bool usp = config.algorithm == cp::CPAlgorithm::kUsp;
  const int64_t kv_per_rank = repeat ? (usp ? 1 : w.heads / u) : w.kv_heads / u;
  const double hidden = w.hidden > 0 ? static_cast<double>(w.hidden) : h;
  // Compute.
  const double attn_flops = 3.5 * 4.0 * b * w.heads * s * s * w.head_dim * (w.causal ? 0.5 : 1.0) *
                            attention_share(p, u, w.causal, config.load_balance);
  double proj_flops = 0;
  if (w.projections) {
    const double s_local = s / static_cast<double>(p);
    proj_flops = 3.0 * 2.0 * b * s_local * hidden * (2 * h + 2 * hkv);
  }
  const double proj_s = proj_flops / (cal.matmul_gflops * 1e9 * share);
  // Attention: the slowest rank's work on one core, or all ranks' work on the cores they
  // share, whichever is longer (with more ranks than cores, a rank that finishes early frees
  // its core for the others).
  const double full_attn = attn_flops / attention_share(p, u, w.causal, config.load_balance);
  const double busy_cores = std::min<double>(cal.cores, ranks);
  double attn_s = std::max(full_attn / (cal.attention_gflops * 1e9 * busy_cores),
                           attn_flops / (cal.attention_gflops * 1e9));
  // The ring's attention beside its shifts (ring and usp): the measured factor, in the work
  // each shift hides behind too.
  if (ring) attn_s *= cal.ring_attention_factor;
  // Where the primitive offers no backward from statistics, the ring's backward recomputes the
  // forward of the C-1 blocks that travelled (1 of the 3.5 forward units again on (C-1)/C of
  // the work; cp/strategy_ring.cpp).
  const double one_pass_s = attn_s;
  const bool recompute = ring && w.ring_recomputes;
  if (recompute) attn_s *= 1.0 + static_cast<double>(c - 1) / (3.5 * static_cast<double>(c));
  out.compute_s = attn_s + proj_s;
  // Communication, forward + backward, e = 4 bytes.
  const double e = 4.0 * b, local = s / static_cast<double>(p);
  double early = 0, late = 0;  // early: launched at a handoff (async can hide it)
  double early_kv = 0;         // of early: the K/V all-to-alls
  double late_a2a = 0;
  double co_gathers = 0;  // hybrid: launched after its all-to-alls (async hides them per block)
  if (u > 1) {
    const double frac = static_cast<double>(u - 1) / static_cast<double>(u);
    const auto& a2a = cal.fit("all_to_all", p);
    for (double width : {h, hkv_moved, hkv_moved})
      early += 2 * a2a.time(local * width * e * frac);
    early_kv = early - 2 * a2a.time(local * h * e * frac);
    late_a2a = 2 * a2a.time(local * h * e * frac);  // the output all-to-all and its inverse
    late += late_a2a;
  }
  double ring_exposed = 0;
  if (c > 1 && ring) {
    // C-1 shifts of the [k | v] block forward; backward the blocks again (unless forward kept
    // them: ring_keep_blocks) and C-1 accumulators, or (where the queries travel: cp/volume.h,
    // ring_moves_queries) C-1 shifts each of [q | dout], [lse | delta] and the dQ accumulator.
    // Each shift flies while a block is attended: exposed is what a step's transfers take
    // beyond the step's attention (forward 1 unit; backward 2.5, and 3.5 where the block's
    // forward is recomputed).
    // A causal layer's chunks travel only as far as they are attended (volume.h:
    // ring_chunk_counts): the bytes of a step are the full block's times the members' mean
    // share of a full pass.
    auto share = [&](bool queries) {
      const auto chunks = cp::ring_member_chunks(p, u, config.load_balance);
      double sent = 0, full = 0;
      for (int64_t m = 0; m < c; ++m) {
        sent += static_cast<double>(cp::ring_chunk_counts(chunks, m, w.causal, queries).sends);
        full += static_cast<double>(cp::ring_chunk_counts(chunks, m, false, queries).sends);
      }
      return full > 0 ? sent / full : 1.0;
    };
    const double kv_share = share(false);
    const auto& a2a = cal.fit("all_to_all", p);
    const double block = local * 2 * hkv_moved * e;
    const double shift = a2a.time(block * kv_share);
    const double unit = one_pass_s / 3.5 / static_cast<double>(c);  // one forward of one step
    const double fwd_step = unit, bwd_step = (recompute ? 3.5 : 2.5) * unit;
    const double steps = static_cast<double>(c - 1);
    const cp::RingHeads ring_heads{w.heads / u, repeat ? 1 : std::max<int64_t>(1, w.kv_heads / u),
                                   w.head_dim, w.head_dim, 4};
    const double bwd_shift =
        cp::ring_moves_queries(config.ring_backward, config.ring_keep_blocks, ring_heads)
            ? a2a.time(local * 2 * h * e * share(true)) +
                  a2a.time(local * 2 * w.heads * e * share(true)) +
                  a2a.time(local * h * e * share(true))
            : (config.ring_keep_blocks ? 1 : 2) * shift;
    late += steps * (shift + bwd_shift);
    ring_exposed =
        (steps * std::max(0.0, shift - fwd_step) + steps * std::max(0.0, bwd_shift - bwd_step)) *
        cal.ring_exposed_scale_at(c);
  } else if (c > 1) {
    const double n = local * hkv_moved * e;  // per rank, per tensor
    const auto& ag = cal.fit("all_gather", p);
    const auto& rs = cal.fit("reduce_scatter", p);
    const double gathers =
        2 * ag.time(n * static_cast<double>(c - 1)) + 2 * rs.time(n * static_cast<double>(c - 1));
    // Hybrid launches its co-group gathers only once the all-to-alls have arrived: they hide
    // behind the co block's diagonal attention, not behind the projections.
    (config.algorithm == cp::CPAlgorithm::kHybrid ? co_gathers : early) += gathers;
  }
  out.comm_s = early + late + co_gathers;
  // Async hides the early collectives behind the projection work that follows them and, for
  // all_gather and ulysses, behind attention on what is already local (cp/overlap.cpp): the
  // own K/V chunks (1/P of the rank's attention) or the own head group's diagonal block
  // (1/P^2).
  double local_share = 0;
  if (config.algorithm == cp::CPAlgorithm::kAllGather) local_share = 1.0 / static_cast<double>(c);
  if (config.algorithm == cp::CPAlgorithm::kUlysses) {
    local_share = 1.0 / static_cast<double>(u * u);
  }
  if (ring) local_share = 0;  // usp's all-to-alls hide behind the projections only
  double early_budget = cal.overlap_budget * proj_s + local_share * attn_s;
  // Async ulysses in G head groups: each of Q, K and V travels in one all-to-all per group, so
  // the later groups' pieces (forward: they launch once group 0's have arrived) and the later
  // groups' dQ, dK, dV (backward: they leave as soon as their group's backward is done) fly
  // while an earlier group is attended; with the output all-to-alls below, within (G-1)/G of
  // the attention.
  // Usp's pieces likewise, while an earlier group's ring runs; they launch once that ring's
  // first shift has landed, and its later shifts and the backward's blocks still share the
  // link with them, so about three quarters of what Ulysses hides (a fit: measured at P = 4,
  // S = 16384 on the 1 Gbit/s link, 2 groups exposed 0.52-0.54 s, the model 0.50 s; with the
  // pieces launched beside the first shift they exposed 0.81-0.94 s; docs/benchmarks.md).
  double ulysses_groups = 1, pieces_hidden = 0;
  if (async && (config.algorithm == cp::CPAlgorithm::kUlysses || usp)) {
    ulysses_groups = static_cast<double>(
        cp::ulysses_head_groups_of(config, w.heads / u, kv_per_rank, p, w.seq / p));
    const double frac = (ulysses_groups - 1) / ulysses_groups;
    // On the repeat path K/V travel whole, before group 0: only the queries' pieces hide
    // behind an earlier group.
    const double forward_in = (repeat ? early - early_kv : early) / 2;
    pieces_hidden = std::min(2 * forward_in * frac, attn_s * frac) * (usp ? 0.75 : 1.0);
    early_budget += pieces_hidden;
  }
  double hidden_s = async ? std::min(early, early_budget) : 0.0;
  // Async all_gather in G head groups: the later groups' K/V gathers fly while the earlier
  // groups are attended, and each group's dK/dV reduce-scatter leaves once its backward is
  // done. The gathers (half of the early bytes) hide only behind forward work after the
  // handoffs (1 of the 3.5 attention units, 1 of the 3 projection passes), the
  // reduce-scatters only behind backward work; of the attention, the held chunks (1/C) and
  // every group's remote keys but the last group's ((G-1)/G of the rest).
  const double ag_groups =
      config.algorithm == cp::CPAlgorithm::kAllGather
          ? static_cast<double>(cp::ulysses_head_groups_of(config, w.heads, w.kv_heads, p))
          : 1.0;
  if (async && ag_groups > 1) {
    const double held = 1.0 / static_cast<double>(c);
    const double attended = held + (1 - held) * (ag_groups - 1) / ag_groups;
    const double fwd = cal.overlap_budget * proj_s / 3 + attended * attn_s / 3.5;
    const double bwd = cal.overlap_budget * proj_s * 2 / 3 + attended * attn_s * 2.5 / 3.5;
    hidden_s = std::min(early / 2, fwd) + std::min(early / 2, bwd);
  }
  // Async hybrid in G head groups (1: the whole heads; cp/strategy_hybrid.cpp), pass by pass.
  // Forward: group 0's Q/K/V pieces hide only behind the projections after their handoffs (1
  // of 3 passes) and the last group's output all-to-all behind nothing; the rest (the later
  // groups' pieces and outputs, every group's co-gathers) flies while the held chunks (1/C)
  // are attended and, of every group's remote keys but the last group's ((G-1)/G of the
  // rest), about half: the link carries the next group's pieces and gathers while they are
  // attended (measured at P = 4, S = 16384 on the 1 Gbit/s link: 0.85, 0.63 and 0.51-0.55 s
  // exposed with 1, 2 and 4 groups; docs/benchmarks.md). Backward mirrors it: the last
  // group's output gradient first (exposed), group 0's dQ, dK, dV last (behind the
  // projections' backward, 2 of 3 passes), the rest behind 2.5 of the 3.5 attention units,
  // with every group's remote keys but the last one's.
  if (async && config.algorithm == cp::CPAlgorithm::kHybrid) {
    const double groups =
        static_cast<double>(cp::ulysses_head_groups_of(config, w.heads / u, kv_per_rank, p));
    const double held = 1.0 / static_cast<double>(c);
    const double attended = held + (1 - held) * (groups - 1) / groups;
    const double fwd_attended = held + (1 - held) * (groups - 1) / groups / 2;
    // Group 0's pieces; on the repeat path the K/V travel whole with them (and their one
    // co-gather is waited for in group 0, so it hides only behind group 0's held chunks).
    const double first = (repeat ? (early - early_kv) / groups + early_kv : early / groups) / 2,
                 last = late_a2a / 2 / groups;
    // The repeat path's one co-gather (every group reads it) hides behind group 0's held
    // chunks in forward, and its reduce-scatter behind the held chunks' backward.
    const double shared = repeat ? co_gathers / 2 : 0.0;
    const double rest = (early + late_a2a + co_gathers) / 2 - first - last - shared;
    const double fwd = std::max(0.0, first - cal.overlap_budget * proj_s / 3) + last +
                       std::max(0.0, rest - fwd_attended * attn_s / 3.5) +
                       std::max(0.0, shared - held / groups * attn_s / 3.5);
    const double bwd = last + std::max(0.0, first - cal.overlap_budget * proj_s * 2 / 3) +
                       std::max(0.0, rest - attended * attn_s * 2.5 / 3.5) +
                       std::max(0.0, shared - held * attn_s * 2.5 / 3.5);
    hidden_s = early + late_a2a + co_gathers - fwd - bwd;
  }
  // Async ulysses and usp in G head groups: the output all-to-alls of all groups but the last
  // (and in backward all but the first) fly while another group is attended. Ulysses sends the
  // last group in R row parts (cp_config.ulysses_row_parts), each flying while the next is
  // attended: all of G R sends but one hide.
  if (async && (config.algorithm == cp::CPAlgorithm::kUlysses || usp)) {
    const double parts =
        usp ? 1.0 : static_cast<double>(cp::ulysses_row_parts_of(config, w.seq / p));
    const double sends = ulysses_groups * parts;
    const double frac = (sends - 1) / sends;
    hidden_s += std::max(0.0, std::min(late_a2a * frac, attn_s * frac - pieces_hidden));
  }
  // The ring hides its own shifts in either schedule (what it cannot hide: ring_exposed).
  out.exposed_comm_s = out.comm_s - hidden_s - (ring ? late - ring_exposed - late_a2a : 0.0);
  out.compute_s += cal.seconds_per_token * b * local / share;
  // The ring's C-1 steps beyond the own block, each over the rank's local tokens (usp: S U / P
  // tokens of H / U heads, the same elements).
  if (ring) {
    out.compute_s +=
        cal.ring_seconds_per_token_step * b * local * static_cast<double>(c - 1) / share;
  }
  // What async costs on the rank's core where it launches collectives at the handoffs (the
  // ring's async schedule is its sync one); Ulysses has its own fit, and usp, whose early
  // collectives are the same all-to-alls (it gathers nothing), pays it too.
  if (async && early + co_gathers > 0) {
    const double per_token = config.algorithm == cp::CPAlgorithm::kUlysses || usp
                                 ? cal.ulysses_async_seconds_per_token
                                 : cal.async_seconds_per_token;
    out.compute_s += per_token * b * local / share;
  }
  out.step_s = out.compute_s + out.exposed_comm_s;
  return out;
}

std::vector<CPPrediction> rank_cp_configs(const Calibration& c, int64_t p, const CPWorkload& w) {
  std::vector<CPPrediction> out;
  for (const auto& cfg : legal_cp_configs(p, w))
    out.push_back(predict_cp_step(c, cfg, p, w));
  HP_CHECK(!out.empty(), "--cp-algo auto: no CP algorithm is legal for cp=", p, ", heads=", w.heads,
           ", kv_heads=", w.kv_heads, ", seq=", w.seq,
           "; change the sizes (see the errors of an explicit --cp-algo)");
  // Equal steps (the rings, kept or not, sync or async, where every shift hides): the choice
  // whose collectives take less link time first, the one a busier link slows least.
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.step_s != b.step_s ? a.step_s < b.step_s : a.comm_s < b.comm_s;
  });
  return out;
}

std::vector<StateExchangePrediction> rank_state_exchanges(const Calibration& c, int64_t p,
                                                          const StateExchangeWorkload& w) {
  HP_CHECK(p >= 2, "cost model: state exchange needs cp_size >= 2, got ", p);
  HP_CHECK(w.value_heads > 0 && w.key_dim > 0 && w.value_dim > 0 && w.batch > 0 && w.layers > 0,
           "cost model: state exchange workload sizes must be positive");
  const double heads = static_cast<double>(w.batch * w.value_heads);
  const double kd = static_cast<double>(w.key_dim), vd = static_cast<double>(w.value_dim);
  const double state_bytes = 4.0 * heads * kd * vd, matrix_bytes = 4.0 * heads * kd * kd;
  const double steps = static_cast<double>(p - 1);
  HP_CHECK(c.matmul_gflops > 0,
           "cost model: the calibration has no matmul rate; rerun hp-bench "
           "calibrate");
  // Up to P-1 folds (K x K times K x V) on a rank, forward and backward (2x each way).
  const double fold = 2.0 * steps * 2.0 * heads * kd * kd * vd / (c.matmul_gflops * 1e9);
  StateExchangePrediction ag{"all_gather"}, p2p{"p2p"};
  ag.comm_s = 2.0 * c.fit("all_gather", p).time(steps * (state_bytes + matrix_bytes));
  p2p.comm_s = 2.0 * steps * c.fit("all_to_all", p).time(state_bytes);
  for (auto* e : {&ag, &p2p}) {
    e->fold_s = fold;
    e->comm_s *= static_cast<double>(w.layers);
    e->fold_s *= static_cast<double>(w.layers);
    e->step_s = e->comm_s + e->fold_s;
  }
  std::vector<StateExchangePrediction> out{ag, p2p};
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.step_s < b.step_s; });
  return out;
}

std::string describe(const StateExchangePrediction& p) {
  return common::str_cat("predicted state_exchange=", p.name, ": ", p.step_s, " s per step = comm ",
                         p.comm_s, " + fold ", p.fold_s);
}

std::string describe(const CPPrediction& p) {
  return common::str_cat("predicted ", p.name, ": step ", p.step_s, " s = compute ", p.compute_s,
                         " + exposed comm ", p.exposed_comm_s, " (of ", p.comm_s, ")");
}

}  // namespace hp::plan
