#include "hp/attention/mixer.h"

#include <cmath>
#include <vector>

#include "hp/common/check.h"
#include "hp/common/shape.h"

namespace hp::attention {
namespace {

void expect_shape(const std::string& who, const char* name, const at::Tensor& t,
                  const std::vector<int64_t>& want, const char* form) {
  HP_CHECK(t.sizes() == at::IntArrayRef(want), who, ": ", name, " has shape ",
           common::shape_str(t.sizes()), "; expected ", common::shape_str(want), " (", form, ")");
}

}  // namespace

MixerShape validate_mixer_inputs(const MixerInputs& in, const MixerOptions& o, GateKind gate,
                                 bool uses_beta, const std::string& who) {
  HP_CHECK(in.q.defined() && in.k.defined() && in.v.defined(), who,
           ": q, k and v must all be defined");
  HP_CHECK(in.q.dim() == 4 && in.v.dim() == 4, who, ": q ", common::shape_str(in.q.sizes()),
           " and v ", common::shape_str(in.v.sizes()),
           " must be 4-d BSHD: q [B, T, H, K], v [B, T, HV, V]");
  MixerShape s;
  s.batch = in.q.size(0);
  s.tokens = in.q.size(1);
  s.heads = in.q.size(2);
  s.key_dim = in.q.size(3);
  s.value_heads = in.v.size(2);
  s.value_dim = in.v.size(3);
  expect_shape(who, "k", in.k, in.q.sizes().vec(), "k is shaped like q: [B, T, H, K]");
  HP_CHECK(in.v.size(0) == s.batch && in.v.size(1) == s.tokens, who, ": v ",
           common::shape_str(in.v.sizes()), " must have q's batch and length [", s.batch, ", ",
           s.tokens, ", HV, V]");
  HP_CHECK(s.heads >= 1 && s.value_heads % s.heads == 0, who, ": value heads HV=", s.value_heads,
           " must be a multiple of q/k heads H=", s.heads,
           " (GVA: value head h reads q/k head h / (HV / H))");
  for (const auto* t : {&in.k, &in.v}) {
    HP_CHECK(t->scalar_type() == in.q.scalar_type(), who, ": q, k, v dtypes differ (",
             c10::toString(in.q.scalar_type()), ", ", c10::toString(in.k.scalar_type()), ", ",
             c10::toString(in.v.scalar_type()), ")");
  }
  HP_CHECK(at::isFloatingType(in.q.scalar_type()), who, ": dtype ",
           c10::toString(in.q.scalar_type()), " is not floating point");
  const std::vector<int64_t> per_head{s.batch, s.tokens, s.value_heads};
  switch (gate) {
    case GateKind::kNone:
      HP_CHECK(!in.g.defined(), who, ": got g but this mixer has no gates; leave g undefined");
      break;
    case GateKind::kPerHead:
      HP_CHECK(in.g.defined(), who, ": g (natural-log gates [B, T, HV]) is required");
      expect_shape(who, "g", in.g, per_head, "one natural-log gate per token and value head");
      break;
    case GateKind::kPerChannel: {
      HP_CHECK(in.g.defined(), who, ": g (natural-log gates [B, T, HV, K]) is required");
      expect_shape(who, "g", in.g, {s.batch, s.tokens, s.value_heads, s.key_dim},
                   "one natural-log gate per token, value head and key channel");
      break;
    }
  }
  if (uses_beta) {
    HP_CHECK(in.beta.defined(), who, ": beta (write strengths [B, T, HV]) is required");
    expect_shape(who, "beta", in.beta, per_head, "one write strength per token and value head");
  } else {
    HP_CHECK(!in.beta.defined(), who, ": got beta but this mixer has none; leave it undefined");
  }
  if (in.initial_state.defined()) {
    expect_shape(who, "initial_state", in.initial_state,
                 {s.batch, s.value_heads, s.key_dim, s.value_dim}, "[B, HV, K, V]");
  }
  if (in.resets.defined()) {
    expect_shape(who, "resets", in.resets, {s.batch, s.tokens},
                 "one document-start flag per token");
    HP_CHECK(in.resets.scalar_type() == at::kBool, who, ": resets has dtype ",
             c10::toString(in.resets.scalar_type()),
             "; it must be bool (true where a document "
             "starts)");
  }
  HP_CHECK(o.chunk_size >= 1, who, ": chunk_size=", o.chunk_size, " must be >= 1");
  s.scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(s.key_dim)));
  HP_CHECK(std::isfinite(s.scale) && s.scale > 0, who, ": scale=", s.scale,
           " must be finite and > 0 (leave it unset for 1/sqrt(key_dim))");
  return s;
}

}  // namespace hp::attention
