#include "manifest.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <type_traits>

#include "hp/common/check.h"
#include "hp/common/crc32.h"
#include "hp/common/strings.h"

namespace hp::train {
namespace fs = std::filesystem;

nlohmann::json to_json(const RankRecord& r) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& f : r.files)
    files[f.name] = {{"bytes", f.bytes}, {"crc32", common::crc32_hex(f.crc32)}};
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : r.tensors)
    tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}});
  return {{"rank", r.rank}, {"files", files}, {"tensors", tensors}};
}

RankRecord rank_record(const nlohmann::json& j) {
  RankRecord r;
  r.rank = j.at("rank").get<int>();
  for (const auto& [name, f] : j.at("files").items()) {
    const auto hex = f.at("crc32").get<std::string>();
    r.files.push_back(
        {name, f.at("bytes").get<int64_t>(), static_cast<uint32_t>(std::stoul(hex, nullptr, 16))});
  }
  for (const auto& t : j.at("tensors")) {
    r.tensors.push_back({t.at("name").get<std::string>(), t.at("shape").get<std::vector<int64_t>>(),
                         t.at("dtype").get<std::string>()});
  }
  return r;
}

nlohmann::json manifest(const TrainOptions& o, int world_size, const std::string& plan,
                        int64_t step, const std::vector<RankRecord>& ranks,
                        const std::string& data_fingerprint) {
  const auto& mc = o.model;
  nlohmann::json records = nlohmann::json::array();
  for (const auto& r : ranks)
    records.push_back(to_json(r));
  return {{"step", step},
          {"data_position", step},  // batches are a pure function of (seed, step)
          {"rng", {{"data_seed", o.seed}, {"model_seed", mc.seed}}},
          {"world_size", world_size},
          {"tp", o.tp},
          {"cp", o.cp},
          {"dp_shard", o.dp_shard},
          {"dp_replicate", o.dp_replicate},
          {"ep", o.ep},
          {"grad_accum", o.grad_accum},
          {"plan", plan},
          {"model",
           {{"vocab", mc.vocab},
            {"layers", mc.layers},
            {"hidden", mc.hidden},
            {"heads", mc.heads},
            {"kv_heads", mc.kv_heads},
            {"head_dim", mc.head_dim},
            {"ffn", mc.ffn},
            {"layer_pattern", mc.layer_pattern},
            {"partial_rotary_factor", mc.partial_rotary_factor},
            {"experts", mc.experts},
            {"moe_top_k", mc.moe_top_k},
            {"capacity_factor", mc.capacity_factor},
            {"aux_loss_coef", mc.aux_loss_coef},
            {"z_loss_coef", mc.z_loss_coef},
            {"moe_renormalize", mc.moe_renormalize},
            {"rope_theta", mc.rope_theta},
            {"rms_eps", mc.rms_eps},
            {"topk", mc.topk},
            {"index_loss", mc.index_loss}}},
          {"train",
           {{"seq_len", o.seq_len},
            {"batch", o.batch},
            {"lr", o.lr},
            {"lr_warmup", o.lr_warmup},
            {"lr_decay_steps", o.lr_decay_steps},
            {"data", o.data},
            {"data_fingerprint", data_fingerprint},
            {"data_dtype", o.data_dtype},
            {"pack_documents", o.pack_documents},
            {"eod_id", o.eod_id},
            {"copy_min_block", o.copy_min_block},
            {"index_loss_coef", o.index_loss_coef}}},
          {"ranks", records}};
}

namespace {

// The settings of `section` that differ from this run's: "flag: checkpoint X, this run Y" each.
// A key the manifest lacks (written by an older hp-train) counts as `fallback` where one is
// given, else is not compared.
struct Differences {
  const nlohmann::json& section;
  std::vector<std::string> found;

  template <typename T>
  void check(const char* key, const T& now, const std::string& flag,
             std::optional<T> fallback = std::nullopt) {
    std::optional<T> was = fallback;
    if (section.contains(key)) was = section.at(key).get<T>();
    if (was && *was != now)
      found.push_back(
          common::str_cat(flag, ": checkpoint ", shown(*was), ", this run ", shown(now)));
  }
  template <typename T>
  static auto shown(const T& v) {
    if constexpr (std::is_same_v<T, bool>) {
      return std::string(v ? "true" : "false");
    } else {
      return v;
    }
  }
  std::string list() const { return common::str_join(found, "; "); }
};

}  // namespace

std::optional<RankRecord> check_manifest(const std::string& dir, int world_size, int rank,
                                         const TrainOptions& o, const Reading& how,
                                         const std::string& data_fingerprint) {
  const std::string& who = how.who;
  const auto path = (fs::path(dir) / "manifest.json").string();
  nlohmann::json m;
  try {
    std::ifstream mf(path);
    HP_CHECK(mf.good(), "it cannot be opened");
    m = nlohmann::json::parse(mf);
    const auto& model = m.at("model");
    Differences layout{m, {}};
    layout.check<int64_t>("world_size", world_size, "--nproc");
    layout.check<int64_t>("tp", o.tp, "--tp");
    layout.check<int64_t>("cp", o.cp, "--cp");
    layout.check<int64_t>("dp_shard", o.dp_shard, "--dp-shard", 1);
    layout.check<int64_t>("dp_replicate", o.dp_replicate, "--dp-replicate", 1);
    layout.check<int64_t>("ep", o.ep, "--ep", 1);
    Differences sizes{model, {}};
    sizes.check<int64_t>("layers", o.model.layers, "--layers");
    sizes.check<int64_t>("hidden", o.model.hidden, "--hidden");
    sizes.check<int64_t>("experts", o.model.experts, "--experts", 0);
    sizes.check<std::string>("layer_pattern", o.model.layer_pattern, "layer pattern (--arch)",
                             std::string());
    layout.found.insert(layout.found.end(), sizes.found.begin(), sizes.found.end());
    HP_CHECK(layout.found.empty(), who, ": checkpoint '", dir,
             "' was written by another layout or model (", layout.list(), "; it was written by ",
             m.at("plan").get<std::string>(),
             "); use the --nproc/--tp/--cp/--dp-shard/--dp-replicate/--ep and model sizes (--arch, "
             "--experts) of the run that wrote it");
    // HSDP shards the parameters on every layout of more than one rank (plan::hsdp_applies);
    // before 2026-12-07 a layout without data parallelism (--cp, --tp) saved whole ones, in
    // another order of the optimizer's state.
    const auto plan = m.at("plan").get<std::string>();
    HP_CHECK(world_size == 1 || plan.find(" hsdp: ") != std::string::npos, who, ": checkpoint '",
             dir,
             "' holds every parameter whole on each rank (written by an hp-train that did not "
             "shard them without data parallelism: ",
             plan,
             "); this hp-train shards them over the ranks and cannot read it: continue it with "
             "the hp-train that wrote it, or start a new run");
    if (!how.weights_only) {
      const auto& train = m.at("train");
      // What the batches and the model's function depend on besides seq_len and seed.
      Differences batches{train, {}};
      batches.check<int64_t>("batch", o.batch, "--batch");
      // The corpus by its content where both runs recorded it (the same file under another path
      // resumes; a file rewritten in place does not), else by its path.
      const bool by_content =
          !data_fingerprint.empty() && !train.value("data_fingerprint", std::string()).empty();
      if (by_content) {
        batches.check<std::string>("data_fingerprint", data_fingerprint, "--data's tokens");
      } else {
        batches.check<std::string>("data", o.data, "--data");
      }
      batches.check<std::string>("data_dtype", o.data_dtype, "--data-dtype");
      batches.check<bool>("pack_documents", o.pack_documents, "--pack-documents");
      batches.check<int64_t>("eod_id", o.eod_id, "--eod-id");
      batches.check<int64_t>("copy_min_block", o.copy_min_block, "--copy-min-block");
      Differences routing{model, {}};
      routing.check<int64_t>("moe_top_k", o.model.moe_top_k, "--top-k");
      routing.check<double>("capacity_factor", o.model.capacity_factor, "--capacity-factor");
      // The model's function besides its sizes (older manifests: not compared).
      routing.check<bool>("moe_renormalize", o.model.moe_renormalize,
                          "--moe-renormalize (config.json norm_topk_prob)");
      routing.check<double>("rope_theta", o.model.rope_theta, "rope_theta (config.json)");
      routing.check<double>("rms_eps", o.model.rms_eps, "rms_eps (config.json rms_norm_eps)");
      routing.check<int64_t>("topk", o.model.topk, "--topk");
      batches.found.insert(batches.found.end(), routing.found.begin(), routing.found.end());
      // grad_accum sits beside train in the manifest.
      Differences accum{m, {}};
      accum.check<int64_t>("grad_accum", o.grad_accum, "--grad-accum");
      batches.found.insert(batches.found.end(), accum.found.begin(), accum.found.end());
      HP_CHECK(batches.found.empty(), who, ": checkpoint '", dir,
               "' was written with other data, routing or model settings (", batches.list(),
               "); resume with the checkpoint's values (the batches and the model's function "
               "depend on them), or start a new run from its weights with --init-weights");
      const int64_t seq_len = train.at("seq_len").get<int64_t>();
      HP_CHECK(seq_len == o.seq_len, who, ": checkpoint '", dir, "' was written with --seq-len ",
               seq_len, ", this run has --seq-len ", o.seq_len,
               "; resume with the same --seq-len (the batches depend on it), or start a new run "
               "at this length from its weights with --init-weights");
      const auto seed = m.at("rng").at("data_seed").get<uint64_t>();
      HP_CHECK(seed == o.seed, who, ": checkpoint '", dir, "' was written with --seed ", seed,
               ", this run has --seed ", o.seed,
               "; resume with the same --seed (the batches are a function of seed and step)");
      // Manifests written before partial RoPE rotated every channel.
      const double rotary = model.value("partial_rotary_factor", 1.0);
      HP_CHECK(rotary == o.model.partial_rotary_factor, who, ": checkpoint '", dir,
               "' was written with partial_rotary_factor ", rotary, ", this run has ",
               o.model.partial_rotary_factor, "; resume with --partial-rotary-factor ", rotary,
               " (the weights were trained with it), or start a new run from its weights with "
               "--init-weights");
      Differences weights{model, {}};
      weights.check<double>("aux_loss_coef", o.model.aux_loss_coef, "--aux-loss-coef");
      weights.check<double>("z_loss_coef", o.model.z_loss_coef, "--z-loss-coef");
      weights.check<std::string>("index_loss", o.model.index_loss, "--index-loss");
      Differences train_weights{train, {}};
      train_weights.check<double>("index_loss_coef", o.index_loss_coef, "--index-loss-coef");
      weights.found.insert(weights.found.end(), train_weights.found.begin(),
                           train_weights.found.end());
      if (!weights.found.empty() && rank == 0) {
        std::printf(
            "%s: warning: checkpoint '%s' was written with other loss weights (%s); the run "
            "continues with the new ones, so it will not follow the original trajectory\n",
            who.c_str(), dir.c_str(), weights.list().c_str());
        std::fflush(stdout);
      }
      const double lr = train.at("lr").get<double>();
      if (lr != o.lr && rank == 0) {
        std::printf(
            "%s: warning: checkpoint '%s' was written with --lr %s, this run has --lr %s; the run "
            "continues with the new rate, so it will not follow the original trajectory\n",
            who.c_str(), dir.c_str(), common::str_cat(lr).c_str(), common::str_cat(o.lr).c_str());
        std::fflush(stdout);
      }
    }
    if (!m.contains("ranks")) {
      if (rank == 0) {
        std::printf(
            "%s: warning: the manifest '%s' records no file checksums (written by an older "
            "hp-train); its files are loaded unverified\n",
            who.c_str(), path.c_str());
        std::fflush(stdout);
      }
      return std::nullopt;
    }
    for (const auto& r : m.at("ranks")) {
      if (r.at("rank").get<int>() == rank) return rank_record(r);
    }
    HP_CHECK(false, who, ": the manifest '", path, "' has no entry for rank ", rank);
  } catch (const nlohmann::json::exception& e) {
    HP_CHECK(false, who, ": cannot read the manifest '", path, "': ", e.what());
  } catch (const hp::Error& e) {
    const std::string what = e.what();
    if (what.rfind(who + ":", 0) == 0) throw;
    HP_CHECK(false, who, ": cannot read the manifest '", path, "': ", what);
  }
  return std::nullopt;  // not reached
}

}  // namespace hp::train
