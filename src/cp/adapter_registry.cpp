#include "hp/common/check.h"
#include "hp/cp/adapter.h"

namespace hp::cp {

const AdapterRegistry& AdapterRegistry::builtin() {
  // Built once, never modified afterwards: immutable shared state, not a mutable global.
  static const AdapterRegistry registry = [] {
    AdapterRegistry r;
    r.add(make_sdpa_qkv_adapter());
    r.add(make_sdpa_hf_adapter());
    r.add(make_flex_qkv_adapter());
    r.add(make_flex_hf_adapter());
    return r;
  }();
  return registry;
}

namespace detail {

attention::AttentionOptions rewrite_positions(const attention::AttentionOptions& o,
                                              const CallState& s, const CPStrategy& strategy) {
  auto out = o;
  if (o.causal) out.causal_meta = strategy.causal_metadata(s);
  if (out.documents) {
    out.documents->kv_start += s.kv_start;
    out.documents->q_start += s.kv_start + s.causal.q_offset;
  }
  return out;
}

attention::AttentionOptions rewrite_mask_fn(const attention::AttentionOptions& o,
                                            const CallState& s) {
  auto out = o;
  if (out.mask_fn) {
    out.mask_fn->q_index_offset += s.kv_start + s.causal.q_offset;
    out.mask_fn->kv_index_offset += s.kv_start;
    out.mask_fn->head_index_offset += s.head_offset;
  }
  return out;
}

}  // namespace detail
}  // namespace hp::cp
