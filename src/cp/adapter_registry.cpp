#include "hp/common/check.h"
#include "hp/cp/adapter.h"

namespace hp::cp {

std::vector<std::string> adapter_names() {
  return {"sdpa_qkv", "sdpa_hf", "flex_qkv", "flex_hf"};
}

bool is_adapter_name(const std::string& name) {
  for (const auto& n : adapter_names()) {
    if (n == name) return true;
  }
  return false;
}

std::shared_ptr<const CPAdapter> adapter_for(const std::string& name) {
  if (name == "sdpa_qkv") return make_sdpa_qkv_adapter();
  if (name == "sdpa_hf") return make_sdpa_hf_adapter();
  if (name == "flex_qkv") return make_flex_qkv_adapter();
  if (name == "flex_hf") return make_flex_hf_adapter();
  HP_CHECK(false, "unknown CP adapter '", name, "'; valid: sdpa_qkv, sdpa_hf, flex_qkv, flex_hf");
}

namespace detail {

attention::AttentionOptions rewrite_causal(const attention::AttentionOptions& o, const CallState& s,
                                           const CPStrategy& strategy) {
  auto out = o;
  if (o.causal) out.causal_meta = strategy.causal_metadata(s);
  return out;
}

attention::AttentionOptions rewrite_mask_fn(const attention::AttentionOptions& o,
                                            const CallState& s) {
  auto out = o;
  if (out.mask_fn) {
    out.mask_fn->q_index_offset += s.causal.q_offset;
    out.mask_fn->head_index_offset += s.head_offset;
  }
  return out;
}

}  // namespace detail
}  // namespace hp::cp
