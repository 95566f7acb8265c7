#include "hp/attention/host.h"

#include "hp/common/check.h"

namespace hp::attention {

const char* slot_name(AttentionHost::Slot slot) {
  return slot == AttentionHost::Slot::kModuleBoundary ? "module boundary (q, k, v)"
                                                      : "primitive call";
}

AttentionHost::AttentionHost(std::string primitive)
    : primitive_name_(std::move(primitive)),
      primitive_(&AttentionRegistry::builtin().get(primitive_name_)) {}

void AttentionHost::set_primitive(const std::string& name) {
  primitive_ = &AttentionRegistry::builtin().get(name);
  primitive_name_ = name;
}

void AttentionHost::install(Slot slot, std::shared_ptr<AttentionInterceptor> interceptor) {
  HP_CHECK(interceptor != nullptr, "AttentionHost::install: interceptor is null");
  auto& target = slot == Slot::kModuleBoundary ? boundary_ : primitive_call_;
  if (target) {
    HP_CHECK(target->id() == interceptor->id(), "a different CP runtime is already installed on ",
             "this attention module's ", slot_name(slot), ": installed '", target->id(), "', new '",
             interceptor->id(),
             "'. Apply context parallelism once per module (re-applying the same plan is fine)");
    return;  // same runtime: idempotent
  }
  target = std::move(interceptor);
}

AttentionInterceptor* AttentionHost::installed(Slot slot) const {
  return (slot == Slot::kModuleBoundary ? boundary_ : primitive_call_).get();
}

bool AttentionHost::has_any_interceptor() const {
  return boundary_ || primitive_call_;
}

AttentionResult AttentionHost::run_boundary(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const AttentionOptions& options,
                                            const AttentionFn& inner,
                                            const StatsBackwardFn& from_stats) {
  if (boundary_) return boundary_->intercept_with_stats(q, k, v, options, inner, from_stats);
  return inner(q, k, v, options);
}

AttentionResult AttentionHost::call_primitive(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v,
                                              const AttentionOptions& options) {
  const AttentionPrimitive* prim = primitive_;
  AttentionFn direct = [prim](const at::Tensor& q2, const at::Tensor& k2, const at::Tensor& v2,
                              const AttentionOptions& o) { return prim->forward(q2, k2, v2, o); };
  if (primitive_call_) {
    return primitive_call_->intercept_with_stats(q, k, v, options, direct,
                                                 primitive_stats_backward());
  }
  return direct(q, k, v, options);
}

StatsBackwardFn AttentionHost::primitive_stats_backward() const {
  const AttentionPrimitive* prim = primitive_;
  if (!prim->offers_backward_from_stats()) return nullptr;
  return
      [prim](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
             const at::Tensor& lse, const at::Tensor& dout, const AttentionOptions& o) {
        return prim->backward_from_stats(q, k, v, out, lse, dout, o);
      };
}

void AttentionHost::announce(const AttentionOptions& options) {
  if (boundary_) boundary_->on_announce(options);
  if (primitive_call_) primitive_call_->on_announce(options);
}

AttentionHost::ForwardScope::ForwardScope(AttentionInterceptor* primitive_call,
                                          AttentionInterceptor* boundary)
    : interceptors_{primitive_call, boundary == primitive_call ? nullptr : boundary} {
  for (auto* i : interceptors_) {
    if (i) i->on_forward_begin();
  }
}

AttentionHost::ForwardScope::ForwardScope(ForwardScope&& other) noexcept
    : interceptors_{other.interceptors_[0], other.interceptors_[1]} {
  other.interceptors_[0] = other.interceptors_[1] = nullptr;
}

AttentionHost::ForwardScope::~ForwardScope() = default;

void AttentionHost::ForwardScope::end() {
  AttentionInterceptor* ends[2] = {interceptors_[0], interceptors_[1]};
  interceptors_[0] = interceptors_[1] = nullptr;
  for (auto* i : ends) {
    if (i) i->on_forward_end();
  }
}

AttentionHost::ForwardScope AttentionHost::forward_scope() {
  return ForwardScope(primitive_call_.get(), boundary_.get());
}

void AttentionHost::add_handoff(HandoffPoint* point) {
  HP_CHECK(point != nullptr, "AttentionHost::add_handoff: point is null");
  HP_CHECK(handoff(point->name()) == nullptr, "AttentionHost::add_handoff: a handoff point named '",
           point->name(), "' is already registered");
  handoffs_.push_back(point);
}

HandoffPoint* AttentionHost::handoff(const std::string& name) const {
  for (auto* h : handoffs_) {
    if (h->name() == name) return h;
  }
  return nullptr;
}

std::vector<std::string> AttentionHost::handoff_names() const {
  std::vector<std::string> out;
  for (auto* h : handoffs_)
    out.push_back(h->name());
  return out;
}

}  // namespace hp::attention
