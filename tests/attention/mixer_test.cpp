// The stateful-mixer contract: every shape rule of hp/attention/mixer.h, asserted by message.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/mixer.h"
#include "hp/common/check.h"
#include "rank_harness.h"

namespace hp::attention {
namespace {

// B=2, T=10, H=2, HV=4 (GVA), K=8, V=6.
MixerInputs inputs(GateKind gate) {
  MixerInputs in;
  in.q = at::randn({2, 10, 2, 8});
  in.k = at::randn({2, 10, 2, 8});
  in.v = at::randn({2, 10, 4, 6});
  if (gate == GateKind::kPerHead) in.g = -at::rand({2, 10, 4});
  if (gate == GateKind::kPerChannel) in.g = -at::rand({2, 10, 4, 8});
  in.beta = at::rand({2, 10, 4});
  in.initial_state = at::randn({2, 4, 8, 6});
  return in;
}

TEST(MixerContract, ValidInputsGiveTheSizes) {
  for (auto gate : {GateKind::kPerHead, GateKind::kPerChannel}) {
    auto s = validate_mixer_inputs(inputs(gate), {}, gate, true, "gdn");
    EXPECT_EQ(s.batch, 2);
    EXPECT_EQ(s.tokens, 10);
    EXPECT_EQ(s.heads, 2);
    EXPECT_EQ(s.value_heads, 4);
    EXPECT_EQ(s.key_dim, 8);
    EXPECT_EQ(s.value_dim, 6);
    EXPECT_DOUBLE_EQ(s.scale, 1.0 / std::sqrt(8.0));
  }
  auto plain = inputs(GateKind::kNone);
  plain.beta = at::Tensor();
  plain.initial_state = at::Tensor();
  MixerOptions o;
  o.scale = 0.5;
  EXPECT_DOUBLE_EQ(validate_mixer_inputs(plain, o, GateKind::kNone, false, "la").scale, 0.5);
}

TEST(MixerContract, EveryRuleNamesTheTensorAndTheExpectedShape) {
  auto in = inputs(GateKind::kPerHead);
  auto check = [&](MixerInputs bad, GateKind gate, const std::string& text) {
    HP_EXPECT_ERROR(validate_mixer_inputs(bad, {}, gate, true, "kda"), text);
  };
  auto bad = in;
  bad.k = at::randn({2, 10, 2, 4});
  check(bad, GateKind::kPerHead, "kda: k has shape [2,10,2,4]; expected [2,10,2,8]");
  bad = in;
  bad.v = at::randn({2, 10, 3, 6});
  check(bad, GateKind::kPerHead, "value heads HV=3 must be a multiple of q/k heads H=2");
  bad = in;
  bad.v = at::randn({2, 9, 4, 6});
  check(bad, GateKind::kPerHead, "must have q's batch and length [2, 10, HV, V]");
  check(in, GateKind::kPerChannel, "g has shape [2,10,4]; expected [2,10,4,8]");
  bad = in;
  bad.g = at::Tensor();
  check(bad, GateKind::kPerHead, "g (natural-log gates [B, T, HV]) is required");
  check(in, GateKind::kNone, "got g but this mixer has no gates");
  bad = in;
  bad.beta = at::rand({2, 10, 2});
  check(bad, GateKind::kPerHead, "beta has shape [2,10,2]; expected [2,10,4]");
  bad = in;
  bad.initial_state = at::randn({2, 2, 8, 6});
  check(bad, GateKind::kPerHead, "initial_state has shape [2,2,8,6]; expected [2,4,8,6]");
  bad = in;
  bad.k = bad.k.to(at::kDouble);
  check(bad, GateKind::kPerHead, "q, k, v dtypes differ (Float, Double, Float)");
  HP_EXPECT_ERROR(validate_mixer_inputs(in, {}, GateKind::kPerHead, false, "x"),
                  "got beta but this mixer has none");
  MixerOptions o;
  o.chunk_size = 0;
  HP_EXPECT_ERROR(validate_mixer_inputs(in, o, GateKind::kPerHead, true, "x"),
                  "chunk_size=0 must be >= 1");
}

}  // namespace
}  // namespace hp::attention
