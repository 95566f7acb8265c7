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
#include "manifest.h"

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
