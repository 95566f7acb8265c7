// CP adapters: *how* a model reaches its attention (DESIGN section 5.5). Independent of the
// strategy: an adapter picks the AttentionHost slot to intercept and rewrites the attention
// options for the post-strategy tensors; the strategy does all communication.
//
//   sdpa_qkv  module boundary (a core-attention module taking q, k, v)   causal -> offsets
//   sdpa_hf   primitive call inside the module forward (misfire detection) causal -> offsets
//   (every adapter places packed-document ids at the block's global positions)
//   flex_qkv  module boundary; mask functions re-based to global positions/heads
//   flex_hf   primitive call; the same for mask functions (block masks are then derived by the
//             primitive for the post-strategy global shapes)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hp/attention/host.h"
#include "hp/common/registry.h"
#include "hp/cp/strategy.h"

namespace hp::cp {

class CPAdapter {
 public:
  virtual ~CPAdapter() = default;
  virtual std::string name() const = 0;
  virtual attention::AttentionHost::Slot slot() const = 0;
  // The options the attention call gets for the post-strategy tensors.
  virtual attention::AttentionOptions rewrite(const attention::AttentionOptions& options,
                                              const CallState& state,
                                              const CPStrategy& strategy) const = 0;
};

std::shared_ptr<const CPAdapter> make_sdpa_qkv_adapter();
std::shared_ptr<const CPAdapter> make_sdpa_hf_adapter();
std::shared_ptr<const CPAdapter> make_flex_qkv_adapter();
std::shared_ptr<const CPAdapter> make_flex_hf_adapter();

// Name -> adapter. builtin() holds sdpa_qkv, sdpa_hf, flex_qkv and flex_hf and is immutable;
// to add an adapter, copy it, add(), and hand the registry to apply through CPApplyOptions.
class AdapterRegistry : public common::NamedRegistry<CPAdapter> {
 public:
  AdapterRegistry() : NamedRegistry("CP adapter") {}
  static const AdapterRegistry& builtin();
};

namespace detail {
// Causal: the strategy's metadata replaces is-causal (never inferred from q_len != kv_len).
// Documents: q_start / kv_start set to the block's global positions (s.kv_start + q_offset and
// s.kv_start), so packed sequences work under every adapter and strategy.
attention::AttentionOptions rewrite_positions(const attention::AttentionOptions& o,
                                              const CallState& s, const CPStrategy& strategy);
// Mask function: local query i is global kv_start + q_offset + i, key j is global kv_start + j,
// heads start at head_offset.
attention::AttentionOptions rewrite_mask_fn(const attention::AttentionOptions& o,
                                            const CallState& s);
}  // namespace detail

}  // namespace hp::cp
