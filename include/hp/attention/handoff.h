// HandoffPoint: an identity the model places after the *last* transform of Q, K or V (after
// RoPE / QK-norm), right before they reach attention. The async CP schedule hooks it to start
// the tensor's collective as soon as it exists, overlapping the rest of the projections.
// Unhooked it returns its input unchanged.
#pragma once

#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

namespace hp::attention {

class HandoffPoint {
 public:
  using Hook = std::function<at::Tensor(const at::Tensor&)>;

  explicit HandoffPoint(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  at::Tensor operator()(const at::Tensor& x) const { return hook_ ? hook_(x) : x; }

  // `owner` identifies who installed the hook; a different owner on a hooked point is an
  // error, the same owner again is a no-op.
  void set_hook(const std::string& owner, Hook hook);
  bool hooked() const { return static_cast<bool>(hook_); }
  const std::string& hook_owner() const { return owner_; }

 private:
  std::string name_;
  std::string owner_;
  Hook hook_;
};

}  // namespace hp::attention
