// torch.save-compatible files for the tool tests (what hp-cp-run reads and writes).
#pragma once

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace hp::testing {

inline void save_dict(const std::string& path, const c10::Dict<std::string, at::Tensor>& d) {
  auto data = torch::jit::pickle_save(c10::IValue(d));
  std::ofstream f(path, std::ios::binary);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

inline c10::Dict<c10::IValue, c10::IValue> load_dict(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes(std::istreambuf_iterator<char>(f), {});
  return torch::jit::pickle_load(bytes).toGenericDict();
}

}  // namespace hp::testing
