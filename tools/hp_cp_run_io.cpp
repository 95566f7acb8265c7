#include "hp_cp_run_io.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include <torch/csrc/jit/serialization/pickle.h>

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
