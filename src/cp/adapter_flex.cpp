// Adapters 'flex_qkv' and 'flex_hf' (mask-function calling conventions), for the same two
// slots as the sdpa pair. Causal is rewritten to the strategy's offsets and the mask function
// re-based to global query positions and head indices, so the primitive derives its block mask
// for the post-strategy global shapes.
#include "hp/cp/adapter.h"

namespace hp::cp {
namespace {

class FlexAdapter final : public CPAdapter {
 public:
  FlexAdapter(std::string name, attention::AttentionHost::Slot slot)
      : name_(std::move(name)), slot_(slot) {}
  std::string name() const override { return name_; }
  attention::AttentionHost::Slot slot() const override { return slot_; }
  attention::AttentionOptions rewrite(const attention::AttentionOptions& o, const CallState& s,
                                      const CPStrategy& strategy) const override {
    return detail::rewrite_mask_fn(detail::rewrite_positions(o, s, strategy), s);
  }

 private:
  std::string name_;
  attention::AttentionHost::Slot slot_;
};

}  // namespace

std::shared_ptr<const CPAdapter> make_flex_qkv_adapter() {
  return std::make_shared<FlexAdapter>("flex_qkv", attention::AttentionHost::Slot::kModuleBoundary);
}

std::shared_ptr<const CPAdapter> make_flex_hf_adapter() {
  return std::make_shared<FlexAdapter>("flex_hf", attention::AttentionHost::Slot::kPrimitiveCall);
}

}  // namespace hp::cp
