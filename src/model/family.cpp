#include "hp/model/family.h"

#include "hp/common/check.h"

namespace hp::model {

const std::vector<std::string>& family_names() {
  static const std::vector<std::string> names{"qwen3", "qwen3-moe", "qwen3.5", "kimi-linear"};
  return names;
}

namespace {

void set_family(Qwen3Config& c, const std::string& arch, FamilyGiven given) {
  constexpr int64_t kDefaultExperts = 8;
  const bool moe_family = arch == "qwen3-moe" || arch == "kimi-linear";
  HP_CHECK(!moe_family || !given.experts || c.experts > 0, "--arch ", arch,
           " is a mixture-of-experts family, but --experts 0 asks for a dense MLP; drop "
           "--experts 0 (",
           arch, " defaults to ", kDefaultExperts, " experts), or use --arch qwen3 or qwen3.5");
  if (moe_family && c.experts == 0) c.experts = kDefaultExperts;
  if (arch == "qwen3" || arch == "qwen3-moe") return;
  if (arch == "qwen3.5") {
    if (c.layer_pattern.empty()) c.layer_pattern = "LLLG";
    c.linear_kind = "gdn";
    c.partial_rotary_factor = 0.25;  // Qwen3-Next / Qwen3.5: a quarter of each head rotates
    return;
  }
  if (arch == "kimi-linear") {
    if (c.layer_pattern.empty()) c.layer_pattern = "LLLM";
    c.linear_kind = "kda";
    return;
  }
  std::string valid;
  for (const auto& n : family_names())
    valid += (valid.empty() ? "" : ", ") + n;
  HP_CHECK(false, "--arch '", arch, "' is not a model family; valid: ", valid);
}

}  // namespace

void apply_family(Qwen3Config& c, const std::string& arch, FamilyGiven given) {
  set_family(c, arch, given);
  const auto n = static_cast<int64_t>(c.layer_pattern.size());
  if (!given.layers && c.layers < n) c.layers = n;
}

}  // namespace hp::model
