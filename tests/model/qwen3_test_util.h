// Shared by the Qwen3 model tests: the small model they train and CP on every attention layer.
#pragma once

#include <memory>
#include <string>

#include "hp/cp/apply.h"
#include "hp/model/qwen3.h"

namespace hp::model::testing {

inline Qwen3Config small_qwen3(int64_t heads = 4, int64_t kv_heads = 2) {
  Qwen3Config c;
  c.vocab = 64;
  c.layers = 2;
  c.hidden = 32;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = 8;
  c.ffn = 64;
  return c;
}

// CP on every decoder layer's self_attn through the primitive-call slot (sdpa_hf), quietly.
inline void apply_cp_to_attention(Qwen3Impl& m, const cp::ContextParallelConfig& cfg,
                                  const std::shared_ptr<const cp::CPTopology>& topo) {
  for (size_t i = 0; i < m.layers.size(); ++i) {
    cp::CPModuleSpec spec;
    spec.module_path = "layers." + std::to_string(i) + ".self_attn";
    spec.inner_wrapper = "sdpa_hf";
    cp::CPApplyOptions o;
    o.log = [](const std::string&) {};
    cp::apply_context_parallel(m.layers[i]->self_attn->host(), spec, cfg, topo, o);
  }
}

}  // namespace hp::model::testing
