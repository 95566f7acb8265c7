// The model-facing surface context parallelism hooks into (DESIGN section 3: models include
// attention/, never cp/).
//
// An attention module owns an AttentionHost. The model reaches attention in one of two ways:
//   * through the module boundary: a core-attention module whose forward takes (q, k, v) runs
//     host.run_boundary(q, k, v, options, inner)           <- what *_qkv adapters intercept
//   * through the primitive call inside a bigger forward (projections, RoPE, ...):
//     host.call_primitive(q, k, v, options)                <- what *_hf adapters intercept
//     inside a `auto scope = host.forward_scope();` that spans the module forward, so an
//     interceptor can tell when a forward never reached the primitive (misfire).
// A module that takes the boundary may open the scope too: it brackets whichever slots hold an
// interceptor. Its begin tells them a new forward starts, so what a failed forward left behind
// (an async CP schedule's collectives started at handoff points) is dropped there.
// With nothing installed both run the host's primitive directly.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/attention/attention.h"
#include "hp/attention/handoff.h"

namespace hp::attention {

using AttentionFn = std::function<AttentionResult(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const AttentionOptions&)>;
// The gradients of one piece of an AttentionFn's call from the whole call's merged statistics
// (AttentionPrimitive::backward_from_stats), for the same function: (q, k, v, out, lse, dout,
// options); `out` in the function's layout, or rowsum(dout * out) with that last dim summed
// away. Empty where the function offers none.
using StatsBackwardFn = std::function<AttentionGrads(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& dout, const AttentionOptions&)>;

// Implemented by cp/ (the CP runtime); anything else may implement it too.
class AttentionInterceptor {
 public:
  virtual ~AttentionInterceptor() = default;
  // Identity: installing an interceptor with the same id twice is a no-op; a different id on
  // an occupied slot is an error.
  virtual std::string id() const = 0;
  // Runs in place of `inner(q, k, v, options)`.
  virtual AttentionResult intercept(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const AttentionOptions& options, const AttentionFn& inner) = 0;
  // The same, where the host can also compute `inner`'s gradients from merged statistics
  // (`from_stats`, empty when it cannot). The default ignores it.
  virtual AttentionResult intercept_with_stats(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const AttentionOptions& options,
                                               const AttentionFn& inner,
                                               const StatsBackwardFn& /*from_stats*/) {
    return intercept(q, k, v, options, inner);
  }
  // Bracket one forward of the host module (AttentionHost::forward_scope). Begin also follows a
  // forward that failed before its end: anything an earlier forward left pending is dropped.
  virtual void on_forward_begin() {}
  virtual void on_forward_end() {}
  // The options the module's next call will pass, told before its projections (see
  // AttentionHost::announce).
  virtual void on_announce(const AttentionOptions& /*options*/) {}
};

class AttentionHost {
 public:
  enum class Slot { kModuleBoundary, kPrimitiveCall };

  explicit AttentionHost(std::string primitive = "blockwise");

  // The primitive used when nothing intercepts (a name from AttentionRegistry::builtin()).
  void set_primitive(const std::string& name);
  const std::string& primitive_name() const { return primitive_name_; }

  // Throws hp::Error when `slot` already holds an interceptor with a different id.
  void install(Slot slot, std::shared_ptr<AttentionInterceptor> interceptor);
  AttentionInterceptor* installed(Slot slot) const;
  bool has_any_interceptor() const;

  // `from_stats`: inner's gradients from merged statistics, when the module has them (empty:
  // none); an interceptor may use it in place of recomputing pieces of the call.
  AttentionResult run_boundary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionOptions& options, const AttentionFn& inner,
                               const StatsBackwardFn& from_stats = nullptr);
  AttentionResult call_primitive(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionOptions& options);
  // The primitive's backward_from_stats (empty when it offers none).
  StatsBackwardFn primitive_stats_backward() const;

  // RAII bracket of one module forward (see above) for the installed interceptors (primitive
  // call, then boundary). Exceptions from on_forward_end (a misfire) are raised by end(); the
  // destructor only closes the bracket (a forward that threw is cleaned up by the next begin,
  // which never blocks an exception on its way out).
  class ForwardScope {
   public:
    ForwardScope(AttentionInterceptor* primitive_call, AttentionInterceptor* boundary);
    ForwardScope(ForwardScope&& other) noexcept;
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;
    ~ForwardScope();
    void end();  // call at the end of a successful forward

   private:
    AttentionInterceptor* interceptors_[2];
  };
  ForwardScope forward_scope();

  // Tells the interceptors, before the projections that feed the handoff points, the options
  // (causal flag, packed documents) the module's next call will pass. Optional: an async CP
  // schedule uses them to skip K/V collectives the documents make useless (all_gather when no
  // query may see another rank's keys); the call must then pass the same causal flag and
  // documents, or it fails with an error naming both. In a module with a forward scope, announce
  // after the scope opens: its begin forgets an earlier forward's announcement.
  void announce(const AttentionOptions& options);

  // Handoff points of this attention module, by name relative to the attention boundary
  // (what cp_handoff_targets refers to). The module owns the points; they must outlive it.
  void add_handoff(HandoffPoint* point);
  HandoffPoint* handoff(const std::string& name) const;  // null when unknown
  std::vector<std::string> handoff_names() const;

 private:
  std::vector<HandoffPoint*> handoffs_;
  std::string primitive_name_;
  const AttentionPrimitive* primitive_;
  std::shared_ptr<AttentionInterceptor> boundary_;
  std::shared_ptr<AttentionInterceptor> primitive_call_;
};

const char* slot_name(AttentionHost::Slot slot);

}  // namespace hp::attention
