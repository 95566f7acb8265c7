#include "hp/train/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <nlohmann/json.hpp>

#include "agree.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/crc32.h"
#include "hp/common/paths.h"
#include "hp/common/strings.h"

namespace hp::train {
namespace fs = std::filesystem;

std::string step_dir(const std::string& root, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return (fs::path(root) / buf).string();
}

namespace {

// The step of a published step directory's name (step_<digits>), or 0 for any other name (a
// .tmp left by a crash has more than digits).
int64_t step_of(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return 0;
  const auto digits = name.substr(5);
  if (digits.empty() || digits.size() > 18 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    return 0;
  return std::stoll(digits);
}

// The newest step under `root` with a manifest, below `limit` (0: none).
int64_t latest_checkpoint_below(const std::string& root, int64_t limit) {
  int64_t best = 0;
  if (!fs::is_directory(root)) return 0;
  for (const auto& e : fs::directory_iterator(root)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step > 0 && step < limit && fs::exists(e.path() / "manifest.json"))
      best = std::max(best, step);
  }
  return best;
}

// For a damaged file of step directory `dir`: how to use the newest older step beside it
// instead (resume, or --init-weights for `who` that reads weights), when there is one ("" else).
std::string older_step_hint(const std::string& dir, const std::string& who) {
  const fs::path p(dir);
  const auto root = p.parent_path().string();
  const int64_t step = step_of(p.filename().string());
  const int64_t before = step > 0 ? latest_checkpoint_below(root, step) : 0;
  if (before == 0) return "";
  if (who.find("--init-weights") != std::string::npos) {
    return common::str_cat("; the step before, '", step_dir(root, before),
                           "', may be whole: give it to --init-weights instead");
  }
  return common::str_cat("; the step before, '", step_dir(root, before), "', may be whole: move '",
                         dir, "' out of '", root, "' to resume from it");
}

}  // namespace

int64_t latest_checkpoint(const std::string& root) {
  return latest_checkpoint_below(root, std::numeric_limits<int64_t>::max());
}

namespace {

std::string file_name(int rank, const char* what) {
  return common::str_cat("rank", rank, ".", what, ".pt");
}

std::string file(const std::string& dir, int rank, const char* what) {
  return (fs::path(dir) / file_name(rank, what)).string();
}

std::string record_file(const std::string& dir, int rank) {
  return (fs::path(dir) / common::str_cat("rank", rank, ".record.json")).string();
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kBool:
      return "bool";
    default:
      return c10::toString(t);
  }
}

std::string describe_shape(const std::vector<int64_t>& shape, const std::string& dtype) {
  return common::str_cat(at::IntArrayRef(shape), " (", dtype, ")");
}

// The text of an exception without LibTorch's backtrace.
std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// Writes `bytes` to `path` (checked) and returns its record.
FileRecord write_file(const std::string& path, const std::string& bytes) {
  common::write_file_synced(path, bytes, "hp-train: checkpoint");
  return {fs::path(path).filename().string(), static_cast<int64_t>(bytes.size()),
          common::crc32(bytes.data(), bytes.size())};
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  HP_CHECK(f.good(), "cannot open '", path, "'");
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

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

// How a checkpoint is read: by --resume (everything; the run continues) or by --init-weights (the
// model tensors only; a new run starts from them). `who` prefixes every message.
struct Reading {
  std::string who;
  bool weights_only = false;
};
const Reading kResume{"hp-train --resume", false};
const Reading kInitWeights{"hp-train --init-weights", true};

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

// The manifest of checkpoint `dir`, checked against this run: world size, layout and model
// (errors); for --resume also what the batches and the model's function depend on (errors) and
// the learning rate and loss weights (warnings on rank 0). Each message names every setting that
// differs with both values. Returns this rank's record; nullopt for a checkpoint written before
// manifests recorded files.
std::optional<RankRecord> check_manifest(const std::string& dir, int world_size, int rank,
                                         const TrainOptions& o, const Reading& how,
                                         const std::string& data_fingerprint = "") {
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

// Runs `load` (which reads `path`), turning a LibTorch error into one that names the file.
void load_guarded(const std::string& path, int rank, const std::string& who,
                  const std::function<void()>& load) {
  try {
    load();
  } catch (const hp::Error&) {
    throw;
  } catch (const std::exception& e) {
    HP_CHECK(false, who, ": rank ", rank, " cannot load '", path, "': ", error_text(e));
  }
}

// `tensors` against the manifest's record of rank `rank`'s model file `path`: the same names,
// shapes and dtypes.
void check_tensors(const NamedTensors& tensors, const RankRecord& record, const std::string& path,
                   const std::string& who) {
  const int rank = record.rank;
  std::map<std::string, const TensorRecord*> saved;
  for (const auto& t : record.tensors)
    saved[t.name] = &t;
  for (const auto& [name, t] : tensors) {
    auto it = saved.find(name);
    HP_CHECK(it != saved.end(), who, ": rank ", rank, ": '", path, "' has no tensor '", name,
             "' (by its manifest), which this run needs; use the model and layout "
             "that wrote the checkpoint");
    const auto& rec = *it->second;
    const std::vector<int64_t> shape = t.sizes().vec();
    const auto dtype = dtype_name(t.scalar_type());
    HP_CHECK(rec.shape == shape && rec.dtype == dtype, who, ": rank ", rank, ": tensor '", name,
             "' has shape ", describe_shape(rec.shape, rec.dtype), " in '", path,
             "' (by its manifest), but this run expects ", describe_shape(shape, dtype),
             "; use the model and layout that wrote the checkpoint");
    saved.erase(it);
  }
  HP_CHECK(saved.empty(), who, ": rank ", rank, ": '", path, "' holds tensor '",
           saved.empty() ? "" : saved.begin()->first,
           "' (by its manifest), which this run's model does not have; resume with the model "
           "and layout that wrote the checkpoint");
}

// The bytes of rank `rank`'s recorded file, checked against its size and CRC-32.
std::string read_verified(const std::string& dir, int rank, const FileRecord& f,
                          const std::string& who) {
  const auto path = (fs::path(dir) / f.name).string();
  HP_CHECK(fs::exists(path), who, ": rank ", rank, "'s file '", path,
           "' is missing (the manifest records ", f.bytes, " bytes)", older_step_hint(dir, who));
  HP_CHECK(fs::is_regular_file(path), who, ": rank ", rank, "'s file '", path,
           "' is not a regular file", older_step_hint(dir, who));
  std::string bytes;
  try {
    bytes = read_file(path);
  } catch (const std::exception& e) {
    HP_CHECK(false, who, ": rank ", rank, "'s file '", path, "' cannot be read: ", e.what(),
             older_step_hint(dir, who));
  }
  HP_CHECK(static_cast<int64_t>(bytes.size()) == f.bytes, who, ": rank ", rank, "'s file '", path,
           "' has ", bytes.size(), " bytes but the manifest records ", f.bytes,
           ": it was truncated or replaced", older_step_hint(dir, who));
  const uint32_t crc = common::crc32(bytes.data(), bytes.size());
  HP_CHECK(crc == f.crc32, who, ": rank ", rank, "'s file '", path, "' is damaged: its CRC-32 is ",
           common::crc32_hex(crc), " but the manifest records ", common::crc32_hex(f.crc32),
           older_step_hint(dir, who));
  return bytes;
}

// The bytes of rank `rank`'s file `name` of `dir`: verified against `record` when there is one.
std::string read_part(const std::string& dir, int rank, const char* what, const RankRecord* record,
                      const std::string& who) {
  const auto name = file_name(rank, what);
  if (record == nullptr) {
    const auto path = file(dir, rank, what);
    HP_CHECK(fs::is_regular_file(path), who, ": rank ", rank, "'s file '", path,
             "' is missing; use the layout that wrote the checkpoint");
    return read_file(path);
  }
  for (const auto& f : record->files) {
    if (f.name == name) return read_verified(dir, rank, f, who);
  }
  HP_CHECK(false, who, ": the manifest of '", dir, "' lists no file '", name, "' for rank ", rank);
  return {};  // not reached
}

// Copies rank `rank`'s saved model tensors of `dir` into `tensors` (checked against `record`
// first when there is one); the optimizer file's bytes are verified too when `optimizer_bytes` is
// given, before anything is loaded.
void load_model_part(const std::string& dir, int rank, const NamedTensors& tensors,
                     const RankRecord* record, const std::string& who,
                     std::string* optimizer_bytes = nullptr) {
  const auto model_path = file(dir, rank, "model");
  if (record != nullptr) check_tensors(tensors, *record, model_path, who);
  const auto model_bytes = read_part(dir, rank, "model", record, who);
  if (optimizer_bytes != nullptr) *optimizer_bytes = read_part(dir, rank, "optim", record, who);
  load_guarded(model_path, rank, who, [&] {
    torch::serialize::InputArchive archive;
    archive.load_from(model_bytes.data(), model_bytes.size());
    at::NoGradGuard no_grad;
    for (const auto& [name, t] : tensors) {
      at::Tensor saved;
      HP_CHECK(archive.try_read(name, saved), who, ": rank ", rank, ": '", model_path,
               "' has no tensor '", name, "'; it was written by another model or layout");
      HP_CHECK(saved.sizes() == t.sizes(), who, ": rank ", rank, ": '", name, "' in '", model_path,
               "' has shape ", saved.sizes(), " but this layout expects ", t.sizes());
      t.detach().copy_(saved);
    }
  });
}

}  // namespace

RankRecord save_rank(const std::string& dir, int rank, const NamedTensors& tensors,
                     torch::optim::Optimizer& optimizer) {
  RankRecord record;
  record.rank = rank;
  torch::serialize::OutputArchive archive;
  for (const auto& [name, t] : tensors) {
    archive.write(name, t.detach());
    record.tensors.push_back({name, t.sizes().vec(), dtype_name(t.scalar_type())});
  }
  std::ostringstream model, optim;
  archive.save_to(model);
  torch::save(optimizer, optim);
  record.files.push_back(write_file(file(dir, rank, "model"), model.str()));
  record.files.push_back(write_file(file(dir, rank, "optim"), optim.str()));
  return record;
}

void load_rank(const std::string& dir, int rank, const NamedTensors& tensors,
               torch::optim::Optimizer& optimizer, const RankRecord* record) {
  // Both files are verified before either is loaded.
  std::string optim_bytes;
  load_model_part(dir, rank, tensors, record, kResume.who, &optim_bytes);
  load_guarded(file(dir, rank, "optim"), rank, kResume.who,
               [&] { torch::load(optimizer, optim_bytes.data(), optim_bytes.size()); });
}

void save_step(const comm::World& world, const TrainOptions& o, const std::string& plan,
               int64_t step, const NamedTensors& tensors, torch::optim::Optimizer& optimizer,
               const std::string& data_fingerprint) {
  const bool rank0 = world.rank() == 0;
  const auto dir = step_dir(o.checkpoint_dir, step);
  const auto tmp = dir + ".tmp";
  const std::string who = "hp-train: checkpoint";
  // Each stage is agreed: a rank that fails (disk full, a path it cannot write) makes every rank
  // fail with its message instead of leaving the others waiting at the next collective.
  run_agreed(world, [&] {
    if (rank0) fs::create_directories(tmp);
  });
  // Each rank writes its part and what it wrote into the temporary directory; rank 0 gathers the
  // records into the manifest and renames the directory once all are there (temp + rename: a
  // crash never leaves a half-written step behind; every file is flushed to the device before
  // the rename publishes it, so a power loss does not either).
  run_agreed(world, [&] {
    const auto record = save_rank(tmp, world.rank(), tensors, optimizer);
    common::write_file_synced(record_file(tmp, world.rank()), to_json(record).dump() + "\n", who);
  });
  run_agreed(world, [&] {
    if (!rank0) return;
    std::vector<RankRecord> records;
    for (int r = 0; r < world.size(); ++r) {
      const auto path = record_file(tmp, r);
      std::ifstream f(path);
      HP_CHECK(f.good(), who, ": rank ", r, " left no record '", path, "'");
      records.push_back(rank_record(nlohmann::json::parse(f)));
      fs::remove(path);
    }
    const auto mpath = (fs::path(tmp) / "manifest.json").string();
    common::write_file_synced(
        mpath, manifest(o, world.size(), plan, step, records, data_fingerprint).dump(2) + "\n",
        who);
    common::sync_dir(tmp, who);
    fs::remove_all(dir);
    fs::rename(tmp, dir);
    common::sync_dir(o.checkpoint_dir, who);
  });
}

int64_t restore_latest(const comm::World& world, const TrainOptions& o, const NamedTensors& tensors,
                       torch::optim::Optimizer& optimizer, const std::string& data_fingerprint) {
  HP_CHECK(!o.checkpoint_dir.empty(), "hp-train: --resume needs --checkpoint-dir");
  const int64_t last = latest_checkpoint(o.checkpoint_dir);
  if (last == 0) {
    HP_CHECK(o.resume_if_exists,
             "hp-train --resume: nothing to resume: no complete checkpoint "
             "under '",
             o.checkpoint_dir,
             "' (no step_* directory with a manifest.json); start "
             "without --resume, or use --resume-if-exists to start fresh when there is none");
    if (world.rank() == 0) {
      std::printf("hp-train: no checkpoint under '%s' yet; starting at step 1\n",
                  o.checkpoint_dir.c_str());
      std::fflush(stdout);
    }
    return 0;
  }
  const auto dir = step_dir(o.checkpoint_dir, last);
  const auto record = check_manifest(dir, world.size(), world.rank(), o, kResume, data_fingerprint);
  // Every rank learns whether all could restore their part (and the first failed rank's reason).
  run_agreed(world, [&] {
    load_rank(dir, world.rank(), tensors, optimizer, record ? &*record : nullptr);
  });
  return last;
}

std::string load_weights(const comm::World& world, const TrainOptions& o,
                         const NamedTensors& tensors) {
  const std::string& from = o.init_weights;
  const std::string& who = kInitWeights.who;
  std::string dir = from;
  if (!fs::exists(fs::path(from) / "manifest.json")) {
    const int64_t last = latest_checkpoint(from);
    HP_CHECK(last > 0, who, ": '", from,
             "' is neither a checkpoint step (a directory with a manifest.json) nor a "
             "--checkpoint-dir holding one; give a step_* directory or the directory above it");
    dir = step_dir(from, last);
  }
  const auto record = check_manifest(dir, world.size(), world.rank(), o, kInitWeights);
  run_agreed(world, [&] {
    load_model_part(dir, world.rank(), tensors, record ? &*record : nullptr, who);
  });
  return dir;
}

}  // namespace hp::train
