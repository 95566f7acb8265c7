// Hugging Face checkpoints: a tiny random qwen3 / qwen3-moe model written by Python (Debian's
// torch; the script writes the safetensors bytes itself: single file or sharded with an index,
// fp32 or bf16, tied embeddings or not) loads into the decoder, whose logits equal a float64
// PyTorch forward of the same architecture written in the script. The safetensors reader
// refuses damaged files naming the file and the tensor.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hp/common/check.h"
#include "hp/model/hf.h"
#include "rank_harness.h"

namespace hp::model {
namespace {

bool python_torch() {
  return std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") == 0;
}

template <typename T>
std::vector<T> read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  const auto bytes = static_cast<size_t>(f.tellg());
  std::vector<T> v(bytes / sizeof(T));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(bytes));
  return v;
}

struct Case {
  std::string type, layout, dtype, tied;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.type << " " << c.layout << " " << c.dtype << " " << c.tied;
}

class HFCheckpoint : public ::testing::TestWithParam<Case> {};

TEST_P(HFCheckpoint, LogitsEqualTheFloat64PyTorchForward) {
  if (!python_torch()) GTEST_SKIP() << "Debian's python3-torch is not installed";
  const auto& c = GetParam();
  const std::string dir =
      hp::testing::scratch_dir() + "/hf_" + c.type + "_" + c.layout + "_" + c.dtype + c.tied;
  auto r =
      hp::testing::run_command("/usr/bin/python3 " + std::string(HP_HF_REFERENCE_SCRIPT) + " " +
                               dir + " " + c.type + " " + c.layout + " " + c.dtype + " " + c.tied);
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto hf = read_hf_config(dir);
  EXPECT_EQ(hf.arch, c.type == "qwen3" ? "qwen3" : "qwen3-moe");
  Qwen3 model(hf.config);
  HFDirectory files(dir);
  for (auto& p : model->named_parameters())
    load_hf_parameter(files, hf.config, p.key(), HFSlice{}, p.value());
  std::ifstream rf(dir + "/reference.json");
  const auto ref = nlohmann::json::parse(rf);
  const int64_t b = ref["batch"], s = ref["seq"], v = ref["vocab"];
  auto ids_v = read_raw<int64_t>(dir + "/ids.bin");
  auto logits_v = read_raw<double>(dir + "/logits.bin");
  auto ids = at::tensor(ids_v, at::kLong).view({b, s});
  auto expected = at::tensor(logits_v, at::kDouble).view({b, s, v});
  auto positions = at::arange(s, at::kLong).expand({b, s}).contiguous();
  at::NoGradGuard guard;
  auto logits = model->forward(ids, positions).to(at::kDouble);
  hp::testing::expect_close(logits, expected, "logits vs float64 PyTorch", 1e-4, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Files, HFCheckpoint,
                         ::testing::Values(Case{"qwen3", "single", "f32", ""},
                                           Case{"qwen3", "sharded", "bf16", "tied"},
                                           Case{"qwen3_moe", "single", "f32", ""},
                                           Case{"qwen3_moe", "sharded", "bf16", ""}),
                         [](const auto& info) {
                           const auto& c = info.param;
                           return c.type + "_" + c.layout + "_" + c.dtype + c.tied;
                         });

// Hugging Face's router_aux_loss_coef weighs one loss over all layers' tokens (k when
// balanced); this decoder sums a per-layer loss of 1 when balanced: read as coef x k / layers,
// written back as the inverse, so a round trip keeps the file's value.
TEST(HFConfig, RouterAuxLossCoefficientIsConvertedBothWays) {
  Qwen3Config c;
  c.layers = 4;
  c.hidden = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.ffn = 48;
  c.experts = 4;
  c.moe_top_k = 2;
  c.aux_loss_coef = 0.0005;
  const std::string dir = hp::testing::scratch_dir() + "/hf_aux_coef";
  write_hf_config(c, dir);
  std::ifstream f(dir + "/config.json");
  const auto j = nlohmann::json::parse(f);
  EXPECT_DOUBLE_EQ(j.at("router_aux_loss_coef").get<double>(), 0.001);
  EXPECT_DOUBLE_EQ(read_hf_config(dir).config.aux_loss_coef, 0.0005);
}

TEST(Safetensors, WriteReadRoundTripAndDamagedFilesAreRefused) {
  const std::string path = hp::testing::scratch_dir() + "/t.safetensors";
  auto a = at::arange(12, at::kFloat).view({3, 4});
  auto b = at::arange(6, at::kFloat).to(at::kBFloat16).view({6});
  {
    SafetensorsWriter w(path, {{"a", at::kFloat, {3, 4}}, {"b", at::kBFloat16, {6}}});
    w.write(a);
    w.write(b);
    w.close();
  }
  {
    SafetensorsFile f(path);
    EXPECT_TRUE(at::equal(f.view("a"), a));
    EXPECT_TRUE(at::equal(f.view("b"), b));
    EXPECT_TRUE(at::equal(f.view("a").narrow(0, 1, 2), a.narrow(0, 1, 2)));
  }
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 4);  // the last tensor loses two values
  try {
    SafetensorsFile f(path);
    ADD_FAILURE() << "a truncated file was accepted";
  } catch (const hp::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tensor 'b'"), std::string::npos) << what;
    EXPECT_NE(what.find("damaged or truncated"), std::string::npos) << what;
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "\x10\x00\x00\x00\x00\x00\x00\x00{}";
  EXPECT_THROW(SafetensorsFile{path}, hp::Error);  // a header longer than the file
  // Headers whose shapes cannot be the data: a negative dimension (its product was positive and
  // passed), a product past int64 (it wrapped), and fields of the wrong type (a raw JSON error).
  const auto with_header = [&](const std::string& header) {
    std::string len(8, '\0');
    for (size_t i = 0, n = header.size(); i < 8; ++i, n >>= 8)
      len[i] = static_cast<char>(n & 0xff);
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        << len << header << std::string(8, '\0');
  };
  const auto expect_refused = [&](const std::string& header, const std::string& text) {
    with_header(header);
    HP_EXPECT_ERROR(SafetensorsFile{path}, text);
  };
  expect_refused(R"({"x": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}})",
                 "tensor 'x' has shape [-1, -2] with a negative dimension");
  expect_refused(
      R"({"x": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
      "tensor 'x' has data_offsets [0, 0) that do not hold its shape x dtype");
  expect_refused(R"({"x": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}})",
                 "tensor 'x' has no valid dtype, shape and data_offsets");
}

}  // namespace
}  // namespace hp::model
