#include "hp_cp_run_io.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include <torch/csrc/jit/serialization/pickle.h>

#include "hp/comm/device_mesh.h"
#include "hp/comm/local_ranks.h"
#include "hp/common/check.h"
#include "hp/common/paths.h"

namespace hp_cp_run {
namespace {

std::vector<char> read_bytes(const std::string& path) {
  HP_CHECK(!std::filesystem::is_directory(path), "hp-cp-run: cannot read --input '", path,
           "': it is a directory; give a torch.save file");
  std::ifstream f(path, std::ios::binary);
  HP_CHECK(f.good(), "hp-cp-run: cannot open --input '", path, "'");
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

void run_cp_thread_ranks(
    int cp_size, const std::function<void(hp::comm::World&, const hp::cp::CPTopology&)>& fn) {
  hp::comm::WorldOptions wo;
  wo.timeout = std::chrono::seconds(120);
  hp::comm::run_thread_ranks(
      cp_size,
      [&](hp::comm::World& w) {
        hp::comm::DeviceMesh mesh(w, {{"cp", cp_size}});
        auto topo = hp::cp::CPTopology::build(
            w, mesh.group_ptr({"cp"}),
            hp::cp::normalize(std::nullopt, cp_size).value_or(hp::cp::ContextParallelConfig{}));
        fn(w, *topo);
      },
      wo);
}

c10::IValue load_file(const std::string& path, const InputHint& hint) {
  const auto bytes = read_bytes(path);
  try {
    return torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    HP_CHECK(false, "hp-cp-run: cannot read --input '", path,
             "' as a torch.save file (save one with ", hint.save,
             "): ", c != nullptr ? c->what_without_backtrace() : e.what());
  }
  return {};  // not reached
}

c10::impl::GenericDict as_dict(const c10::IValue& file, const std::string& path,
                               const InputHint& hint) {
  HP_CHECK(file.isGenericDict(), "hp-cp-run: '", path, "' does not hold a dict (save one with ",
           hint.save, ")");
  return file.toGenericDict();
}

at::Tensor entry(const c10::IValue& file, const std::string& key, const std::string& path,
                 const InputHint& hint) {
  auto d = as_dict(file, path, hint);
  HP_CHECK(d.contains(key), "hp-cp-run: '", path, "' has no entry '", key, "'; it needs ",
           hint.needs);
  auto t = d.at(key);
  HP_CHECK(t.isTensor(), "hp-cp-run: entry '", key, "' in '", path, "' is not a tensor");
  return t.toTensor().contiguous();
}

void check_output(const std::string& path) {
  const auto why = hp::common::why_file_unwritable(path);
  HP_CHECK(why.empty(), "hp-cp-run: cannot write --output '", path, "': ", why);
}

void write_dict(const std::string& path, const c10::Dict<std::string, at::Tensor>& d) {
  auto data = torch::jit::pickle_save(c10::IValue(d));
  const std::string tmp = path + ".tmp";
  bool ok = false;
  {
    std::ofstream f(tmp, std::ios::binary);
    HP_CHECK(f.good(), "hp-cp-run: cannot write --output '", path, "' (its temporary file '", tmp,
             "')");
    f.write(data.data(), static_cast<std::streamsize>(data.size()));
    f.close();
    ok = !f.fail() && std::rename(tmp.c_str(), path.c_str()) == 0;
  }
  if (!ok) std::remove(tmp.c_str());  // never left behind
  HP_CHECK(ok, "hp-cp-run: cannot write the result to --output '", path, "'");
}

}  // namespace hp_cp_run
