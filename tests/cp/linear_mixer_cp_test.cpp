// Mixer-level linear-attention CP (linear_mixer_cp): GDN and KDA, ulysses and state_passing
// (all_gather and p2p), P in {2, 3, 4}, float64, with a user initial state and a gradient of the
// final state: out, final_state and every gradient (q, k, v, g, beta, the initial state summed
// over ranks) equal the single-process chunked kernel and the token recurrence; the bytes each
// rank sent equal the formula; bad input is refused before any collective.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "hp/attention/delta_rule.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/linear_mixer.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using attention::GateKind;
using attention::MixerInputs;
using hp::testing::expect_close;
using hp::testing::run_ranks;

// H = 12 divides by 2, 3 and 4; T = 24 too; chunks of 4 leave partial chunks in the shards.
struct Sizes {
  int64_t batch = 2, tokens = 24, heads = 12, value_heads = 24, key_dim = 4, value_dim = 3;
  int64_t chunk = 4;
};

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

// The whole sequence (plain tensors, no grad): q, k L2-normalised as the layers do.
MixerInputs whole(GateKind gate, const Sizes& s) {
  auto normed = [](const at::Tensor& t) { return t / t.norm(2, -1, true); };
  MixerInputs in;
  in.q = normed(rnd(1, {s.batch, s.tokens, s.heads, s.key_dim}));
  in.k = normed(rnd(2, {s.batch, s.tokens, s.heads, s.key_dim}));
  in.v = rnd(3, {s.batch, s.tokens, s.value_heads, s.value_dim});
  std::vector<int64_t> gshape{s.batch, s.tokens, s.value_heads};
  if (gate == GateKind::kPerChannel) gshape.push_back(s.key_dim);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  in.g = at::rand(gshape, gen, at::kDouble) * -2.0;
  in.beta = at::sigmoid(rnd(5, {s.batch, s.tokens, s.value_heads}));
  in.initial_state = rnd(6, {s.batch, s.value_heads, s.key_dim, s.value_dim}) * 0.5;
  return in;
}

std::vector<at::Tensor*> fields(MixerInputs& in) {
  return {&in.q, &in.k, &in.v, &in.g, &in.beta, &in.initial_state};
}
constexpr const char* kNames[] = {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};

// Outputs and the gradient of each input (kNames order).
struct Result {
  at::Tensor out, final_state;
  std::vector<at::Tensor> grads;
};

Result reference(const MixerInputs& w, GateKind gate, const Sizes& s, bool chunked,
                 const at::Tensor& dout, const at::Tensor& dfinal) {
  auto in = w;
  for (auto* t : fields(in)) {
    if (t->defined()) *t = t->clone().requires_grad_(true);
  }
  attention::MixerOptions o;
  o.output_final_state = true;
  o.chunk_size = s.chunk;
  auto r = chunked ? attention::delta_rule_chunked(in, o, gate)
                   : attention::delta_rule_recurrent(in, o, gate);
  torch::autograd::backward({r.out, r.final_state}, {dout, dfinal});
  Result res{r.out.detach(), r.final_state.detach(), {}};
  for (auto* t : fields(in))
    res.grads.push_back(t->defined() ? t->grad() : at::Tensor());
  return res;
}

struct Case {
  std::string mixer, mode, exchange;
  int p;
  std::string kernel = "chunked";
  bool initial_state = true;
  bool final_state = true;
  std::vector<int64_t> lengths = {};  // state_passing: unequal shards (sum T); empty: T/P each
  bool documents = false;             // packed documents: resets sharded with the tokens
};

// Document starts of the whole [2, 24] batch: row 0 at 3, 4 (a one-token document), 8 (a rank
// boundary for P = 3), 13 and 20; row 1 at token 0 (the initial state dropped) and 12.
at::Tensor resets_of_the_batch() {
  auto r = at::zeros({2, 24}, at::kBool);
  for (int64_t t : {3, 4, 8, 13, 20})
    r[0][t] = true;
  r[1][0] = true;
  r[1][12] = true;
  return r;
}

void run_case(const Case& c) {
  const Sizes s;
  const auto gate = c.mixer == "kda" ? GateKind::kPerChannel : GateKind::kPerHead;
  auto w = whole(gate, s);
  if (!c.initial_state) w.initial_state = at::Tensor();
  if (c.documents) w.resets = resets_of_the_batch();
  auto dout = rnd(7, {s.batch, s.tokens, s.value_heads, s.value_dim});
  auto dfinal = rnd(8, {s.batch, s.value_heads, s.key_dim, s.value_dim});
  if (!c.final_state) dfinal.zero_();
  const auto chunked = reference(w, gate, s, true, dout, dfinal);
  const auto recurrent = reference(w, gate, s, false, dout, dfinal);
  std::vector<int64_t> starts{0}, lengths = c.lengths;
  if (lengths.empty()) lengths.assign(c.p, s.tokens / c.p);
  for (int64_t l : lengths)
    starts.push_back(starts.back() + l);
  const std::string what = c.mixer + " " + c.mode + "/" + c.exchange + " " + c.kernel +
                           " P=" + std::to_string(c.p) + (c.documents ? " packed" : "");
  run_ranks(c.p, [&](comm::World& world) {
    comm::DeviceMesh mesh(world, {{"cp", c.p}});
    auto topo = CPTopology::build(world, mesh.group_ptr({"cp"}), *normalize(std::nullopt, c.p));
    const int64_t r = world.rank(), t0 = starts[r], len = lengths[r];
    auto shard = w;
    for (auto* t : fields(shard)) {
      if (!t->defined()) continue;
      *t = (t == &shard.initial_state ? *t : t->narrow(1, t0, len)).clone().requires_grad_(true);
    }
    if (c.documents) shard.resets = w.resets.narrow(1, t0, len);
    attention::MixerOptions o;
    o.output_final_state = c.final_state;
    o.chunk_size = s.chunk;
    LinearMixerCPOptions cp;
    cp.mode = c.mode;
    cp.state_exchange = c.exchange;
    cp.kernel = c.kernel;
    world.context().counters.reset();
    auto res = linear_mixer_cp(shard, o, gate, cp, *topo);
    if (c.final_state) {
      // The loss is the sum of the ranks' losses: the final state's gradient on one rank.
      torch::autograd::backward(
          {res.out, res.final_state},
          {dout.narrow(1, t0, len), r == 0 ? dfinal : at::zeros_like(dfinal)});
    } else {
      EXPECT_FALSE(res.final_state.defined()) << what;
      torch::autograd::backward({res.out}, {dout.narrow(1, t0, len)});
    }
    const int64_t sent = world.context().counters.total_bytes();
    const std::string who = what + " rank " + std::to_string(r);
    for (const auto* ref : {&chunked, &recurrent}) {
      const std::string kind = ref == &chunked ? " (vs chunked)" : " (vs recurrent)";
      expect_close(res.out, ref->out.narrow(1, t0, len), common::str_cat(who, " out", kind), 1e-9,
                   1e-9);
      if (c.final_state) {
        expect_close(res.final_state, ref->final_state, common::str_cat(who, " final_state", kind),
                     1e-9, 1e-9);
      }
      auto f = fields(shard);
      for (size_t i = 0; i + 1 < f.size(); ++i) {
        expect_close(f[i]->grad(), ref->grads[i].narrow(1, t0, len),
                     common::str_cat(who, " ", kNames[i], kind), 1e-9, 1e-9);
      }
      if (c.initial_state) {
        auto mine = shard.initial_state.grad();
        if (!mine.defined()) mine = at::zeros_like(shard.initial_state);
        auto total = comm::all_reduce(mesh.group("cp"), mine);
        expect_close(total, ref->grads.back(),
                     common::str_cat(who, " dinitial_state (sum over ranks)", kind), 1e-9, 1e-9);
      }
    }
    attention::MixerShape global{s.batch, s.tokens, s.heads, s.value_heads, s.key_dim, s.value_dim};
    const auto sizes = LinearMixerElementSizes::of(shard);
    const int64_t formula =
        linear_mixer_forward_bytes_per_rank(global, gate, cp, c.p, sizes, c.final_state);
    const int64_t forward = linear_mixer_forward_bytes_per_rank(global, gate, cp, c.p, sizes,
                                                                c.final_state, c.documents);
    EXPECT_GT(formula, 0) << who;
    EXPECT_EQ(forward - formula,
              c.documents && c.mode == "ulysses" ? (c.p - 1) * s.batch * (s.tokens / c.p) : 0)
        << who;
    EXPECT_EQ(sent, forward + formula) << who << ": bytes sent in forward + backward";
  });
}

TEST(LinearMixerCP, UlyssesEqualsTheSingleProcessKernel) {
  for (const std::string mixer : {"gdn", "kda"})
    for (int p : {2, 3, 4})
      run_case({mixer, "ulysses", "all_gather", p});
}

TEST(LinearMixerCP, StatePassingAllGatherEqualsTheSingleProcessKernel) {
  for (const std::string mixer : {"gdn", "kda"})
    for (int p : {2, 3, 4})
      run_case({mixer, "state_passing", "all_gather", p});
}

TEST(LinearMixerCP, StatePassingP2PEqualsTheSingleProcessKernel) {
  for (const std::string mixer : {"gdn", "kda"})
    for (int p : {2, 3, 4})
      run_case({mixer, "state_passing", "p2p", p});
}

TEST(LinearMixerCP, WithoutInitialOrFinalStateAndWithTheRecurrentKernel) {
  for (const std::string exchange : {"all_gather", "p2p"}) {
    run_case({"kda", "state_passing", exchange, 3, "chunked", false, false});
    run_case({"gdn", "state_passing", exchange, 2, "recurrent", true, true});
  }
  run_case({"gdn", "ulysses", "all_gather", 3, "chunked", false, false});
  run_case({"kda", "ulysses", "all_gather", 2, "recurrent", true, true});
}

TEST(LinearMixerCP, StatePassingTakesUnequalShards) {
  run_case({"gdn", "state_passing", "all_gather", 3, "chunked", true, true, {5, 12, 7}});
  run_case({"kda", "state_passing", "p2p", 2, "chunked", true, true, {17, 7}});
}

TEST(LinearMixerCP, PackedDocumentsEqualTheSingleProcessKernel) {
  for (const std::string mixer : {"gdn", "kda"}) {
    for (int p : {2, 3, 4}) {
      Case ulysses{mixer, "ulysses", "all_gather", p};
      ulysses.documents = true;
      run_case(ulysses);
      for (const std::string exchange : {"all_gather", "p2p"}) {
        Case sp{mixer, "state_passing", exchange, p};
        sp.documents = true;
        run_case(sp);
      }
    }
  }
  Case unequal{"kda", "state_passing", "p2p", 3, "chunked", true, true, {5, 12, 7}};
  unequal.documents = true;
  run_case(unequal);
}

TEST(LinearMixerCP, RefusesBadInputBeforeAnyCollective) {
  run_ranks(2, [](comm::World& world) {
    comm::DeviceMesh mesh(world, {{"cp", 2}});
    auto topo = CPTopology::build(world, mesh.group_ptr({"cp"}), *normalize(std::nullopt, 2));
    Sizes s;
    s.heads = 3;
    s.value_heads = 3;
    auto in = whole(GateKind::kPerHead, s);
    attention::MixerOptions o;
    LinearMixerCPOptions cp;
    world.context().counters.reset();
    cp.mode = "ulysses";
    HP_EXPECT_ERROR(linear_mixer_cp(in, o, GateKind::kPerHead, cp, *topo),
                    "mode=ulysses needs q/k heads (3) and value heads (3) divisible by cp_size=2");
    cp.mode = "ring";
    HP_EXPECT_ERROR(linear_mixer_cp(in, o, GateKind::kPerHead, cp, *topo),
                    "mode='ring' is not valid; valid: ulysses, state_passing");
    cp.mode = "state_passing";
    cp.state_exchange = "tree";
    HP_EXPECT_ERROR(linear_mixer_cp(in, o, GateKind::kPerHead, cp, *topo),
                    "state_exchange='tree' is not valid; valid: all_gather, p2p");
    cp.state_exchange = "p2p";
    cp.kernel = "fused";
    HP_EXPECT_ERROR(linear_mixer_cp(in, o, GateKind::kPerHead, cp, *topo),
                    "kernel='fused' is not valid; valid: chunked, recurrent");
    cp.kernel = "chunked";
    // KDA's per-channel gates on GDN's per-head g.
    HP_EXPECT_ERROR(linear_mixer_cp(in, o, GateKind::kPerChannel, cp, *topo),
                    "g has shape [2,24,3]; expected [2,24,3,4]");
    in.initial_state = at::zeros({2, 3, 4, 4}, at::kDouble);
    HP_EXPECT_ERROR(linear_mixer_cp(in, o, GateKind::kPerHead, cp, *topo),
                    "initial_state has shape [2,3,4,4]; expected [2,3,4,3]");
    EXPECT_EQ(world.context().counters.total_bytes(), 0);
  });
}

}  // namespace
}  // namespace hp::cp
