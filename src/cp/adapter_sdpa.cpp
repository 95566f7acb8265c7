// Adapters 'sdpa_qkv' and 'sdpa_hf' (SDPA-style calling conventions). They differ only in the
// slot they intercept: the module boundary (a core-attention module taking q, k, v) or the
// primitive call inside a module's forward (misfire detection by the runtime). Causal is
// rewritten to the strategy's offsets; mask functions are refused (flex_* re-base them).
#include "hp/common/check.h"
#include "hp/cp/adapter.h"

namespace hp::cp {
namespace {

class SdpaAdapter final : public CPAdapter {
 public:
  SdpaAdapter(std::string name, attention::AttentionHost::Slot slot)
      : name_(std::move(name)), slot_(slot) {}
  std::string name() const override { return name_; }
  attention::AttentionHost::Slot slot() const override { return slot_; }
  attention::AttentionOptions rewrite(const attention::AttentionOptions& o, const CallState& s,
                                      const CPStrategy& strategy) const override {
    HP_CHECK(!o.mask_fn, "CP adapter '", name_,
             "' got a mask function; mask functions need a flex adapter (flex_qkv or flex_hf) "
             "so they are re-based to global positions");
    return detail::rewrite_positions(o, s, strategy);
  }

 private:
  std::string name_;
  attention::AttentionHost::Slot slot_;
};

}  // namespace

std::shared_ptr<const CPAdapter> make_sdpa_qkv_adapter() {
  return std::make_shared<SdpaAdapter>("sdpa_qkv", attention::AttentionHost::Slot::kModuleBoundary);
}

std::shared_ptr<const CPAdapter> make_sdpa_hf_adapter() {
  return std::make_shared<SdpaAdapter>("sdpa_hf", attention::AttentionHost::Slot::kPrimitiveCall);
}

}  // namespace hp::cp
