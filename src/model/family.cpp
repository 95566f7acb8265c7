#include "hp/model/family.h"

#include "hp/common/check.h"

namespace hp::model {

const std::vector<std::string>& family_names() {
  static const std::vector<std::string> names{"qwen3", "qwen3-moe", "qwen3.5", "kimi-linear"};
  return names;
}

void apply_family(Qwen3Config& c, const std::string& arch) {
  constexpr int64_t kDefaultExperts = 8;
  if (arch == "qwen3") return;
  if (arch == "qwen3-moe") {
    if (c.experts == 0) c.experts = kDefaultExperts;
    return;
  }
  if (arch == "qwen3.5") {
    if (c.layer_pattern.empty()) c.layer_pattern = "LLLG";
    c.linear_kind = "gdn";
    c.partial_rotary_factor = 0.25;  // Qwen3-Next / Qwen3.5: a quarter of each head rotates
    return;
  }
  if (arch == "kimi-linear") {
    if (c.layer_pattern.empty()) c.layer_pattern = "LLLM";
    c.linear_kind = "kda";
    if (c.experts == 0) c.experts = kDefaultExperts;
    return;
  }
  std::string valid;
  for (const auto& n : family_names())
    valid += (valid.empty() ? "" : ", ") + n;
  HP_CHECK(false, "--arch '", arch, "' is not a model family; valid: ", valid);
}

}  // namespace hp::model
