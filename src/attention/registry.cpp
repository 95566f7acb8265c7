#include <algorithm>

#include "hp/attention/attention.h"
#include "hp/common/check.h"
#include "hp/common/torch_compat.h"

namespace hp::attention {

std::unique_ptr<AttentionPrimitive> make_sdpa_attention();  // sdpa_attention.cpp

AttentionGrads AttentionPrimitive::backward_from_stats(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&,
                                                       const AttentionOptions&) const {
  HP_CHECK(false, "attention '", name(),
           "' does not offer backward_from_stats (offers_backward_from_stats() is false); use "
           "its forward's autograd, or the 'blockwise' primitive");
}

const AttentionRegistry& AttentionRegistry::builtin() {
  // Built once, never modified afterwards: immutable shared state, not a mutable global.
  static const AttentionRegistry registry = [] {
    AttentionRegistry r;
    r.add(make_math_attention());
    r.add(make_blockwise_attention());
    if (compat::kHasSdpa) r.add(make_sdpa_attention());
    return r;
  }();
  return registry;
}

void AttentionRegistry::add(std::unique_ptr<AttentionPrimitive> primitive) {
  HP_CHECK(primitive != nullptr, "AttentionRegistry::add: primitive is null");
  HP_CHECK(!contains(primitive->name()), "AttentionRegistry::add: a primitive named '",
           primitive->name(), "' is already registered");
  primitives_.push_back(std::move(primitive));
}

bool AttentionRegistry::contains(const std::string& name) const {
  return std::any_of(primitives_.begin(), primitives_.end(),
                     [&](const auto& p) { return p->name() == name; });
}

const AttentionPrimitive& AttentionRegistry::get(const std::string& name) const {
  for (const auto& p : primitives_) {
    if (p->name() == name) return *p;
  }
  std::string valid;
  for (const auto& n : names())
    valid += (valid.empty() ? "" : ", ") + n;
  HP_CHECK(false, "unknown attention primitive '", name, "'; valid: ", valid);
}

std::vector<std::string> AttentionRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& p : primitives_)
    out.push_back(p->name());
  return out;
}

}  // namespace hp::attention
