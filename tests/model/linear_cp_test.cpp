// Linear-attention CP (GDN, KDA): ulysses and state_passing (all_gather and p2p state
// exchange), P in {2, 3, 4}: the layer's output, dx and every parameter gradient (summed over
// CP) equal the single-process layer — conv halos at every rank boundary included — with and
// without packed documents.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/linear.h"
#include "hp/model/linear_attention.h"
#include "rank_harness.h"

namespace hp::model {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kS = 48, kHidden = 20;

LinearAttentionConfig config(const std::string& mixer) {
  LinearAttentionConfig c;
  c.mixer = mixer;
  c.hidden = kHidden;
  c.heads = 12;
  c.value_heads = 24;
  c.key_dim = 4;
  c.value_dim = 3;
  c.gate_rank = 4;
  c.chunk_size = 8;
  return c;
}

struct Reference {
  at::Tensor y, dx;
  std::map<std::string, at::Tensor> grads;
};

Reference reference(const std::string& mixer, const at::Tensor& x, const at::Tensor& dy,
                    const at::Tensor& doc_ids) {
  LinearAttention m(config(mixer));
  m->to(at::kDouble);
  auto xx = x.clone().requires_grad_(true);
  auto y = m->forward(xx, doc_ids);
  y.backward(dy);
  Reference r{y.detach(), xx.grad(), {}};
  for (const auto& p : m->named_parameters())
    r.grads[p.key()] = p.value().grad();
  return r;
}

// doc_ids: packed documents of the whole sequence (undefined: none); the reference is the
// single-process layer with the same documents.
void run_mode(const std::string& mixer, const std::string& mode, const std::string& exchange, int p,
              cp::CPSchedule schedule, const at::Tensor& doc_ids = {}) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  auto x = at::randn({2, kS, kHidden}, gen, at::kDouble);
  auto dy = at::randn({2, kS, kHidden}, gen, at::kDouble);
  auto ref = reference(mixer, x, dy, doc_ids);
  run_ranks(p, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = cp::CPTopology::build(w, mesh.group_ptr({"cp"}), *cp::normalize(std::nullopt, p));
    LinearAttention m(config(mixer));
    m->to(at::kDouble);
    cp::LinearCPOptions o;
    o.module_path = "layers.0.linear_attn";
    o.mode = mode;
    o.state_exchange = exchange;
    o.schedule = schedule;
    auto line = cp::apply_linear_cp(m->host(), m->shape(), o, topo);
    EXPECT_NE(line.find("mode=" + mode), std::string::npos) << line;
    EXPECT_NE(line.find(std::string("schedule=") + cp::to_string(schedule)), std::string::npos)
        << line;
    const int64_t r = w.rank(), s = kS / p;
    auto xs = x.narrow(1, r * s, s).clone().requires_grad_(true);
    auto y = m->forward(xs, doc_ids);
    y.backward(dy.narrow(1, r * s, s));
    const std::string what = mixer + " " + mode + "/" + exchange + " " + cp::to_string(schedule) +
                             " P=" + std::to_string(p) + " rank " + std::to_string(r) +
                             (doc_ids.defined() ? " packed" : "");
    expect_close(y, ref.y.narrow(1, r * s, s), what + " y", 1e-9, 1e-9);
    expect_close(xs.grad(), ref.dx.narrow(1, r * s, s), what + " dx", 1e-9, 1e-9);
    for (const auto& par : m->named_parameters()) {
      auto g = comm::all_reduce(mesh.group("cp"), par.value().grad());
      expect_close(g, ref.grads.at(par.key()), what + " d" + par.key(), 1e-9, 1e-9);
    }
  });
}

TEST(LinearCP, UlyssesEqualsTheSingleProcessLayer) {
  for (auto schedule : {cp::CPSchedule::kSync, cp::CPSchedule::kAsync})
    for (const std::string mixer : {"gdn", "kda"})
      for (int p : {2, 3, 4})
        run_mode(mixer, "ulysses", "all_gather", p, schedule);
}

TEST(LinearCP, StatePassingAllGatherEqualsTheSingleProcessLayer) {
  for (auto schedule : {cp::CPSchedule::kSync, cp::CPSchedule::kAsync})
    for (const std::string mixer : {"gdn", "kda"})
      for (int p : {2, 3, 4})
        run_mode(mixer, "state_passing", "all_gather", p, schedule);
}

TEST(LinearCP, StatePassingP2PEqualsTheSingleProcessLayer) {
  for (auto schedule : {cp::CPSchedule::kSync, cp::CPSchedule::kAsync})
    for (const std::string mixer : {"gdn", "kda"})
      for (int p : {2, 3, 4})
        run_mode(mixer, "state_passing", "p2p", p, schedule);
}

TEST(LinearCP, PackedDocumentsEqualTheSingleProcessLayer) {
  // Row 0: documents [0, 5) [5, 6) [6, 20) [20, 33) [33, 48): they span the rank boundaries of
  // P = 2, 3 and 4 (24; 16, 32; 12, 36), and [5, 6) is shorter than the conv halo. Row 1:
  // documents that start exactly at rank boundaries (12, 24) and one at 40.
  auto ids = at::zeros({2, kS}, at::kLong);
  for (int64_t start : {5, 6, 20, 33})
    ids[0].narrow(0, start, kS - start).add_(1);
  for (int64_t start : {12, 24, 40})
    ids[1].narrow(0, start, kS - start).add_(1);
  for (auto schedule : {cp::CPSchedule::kSync, cp::CPSchedule::kAsync}) {
    for (const std::string mixer : {"gdn", "kda"}) {
      for (int p : {2, 3, 4}) {
        run_mode(mixer, "ulysses", "all_gather", p, schedule, ids);
        run_mode(mixer, "state_passing", "all_gather", p, schedule, ids);
        run_mode(mixer, "state_passing", "p2p", p, schedule, ids);
      }
    }
  }
  // One row of ids for every batch row ([1, S]) is the same documents broadcast.
  run_mode("gdn", "state_passing", "p2p", 4, cp::CPSchedule::kSync, ids.narrow(0, 0, 1));
}

// The stages as a CP mode calls them, each call logged; project_out_gate also logs the
// collectives launched so far ("project_out_gate after N").
class LoggedStages final : public attention::LinearLayerStages {
 public:
  LoggedStages(const LinearAttentionImpl& inner, const comm::CollectiveRecorder& rec)
      : inner_(inner), rec_(rec) {}
  mutable std::vector<std::string> log;  // the calls, in order

  attention::LinearLayerShape shape() const override { return inner_.shape(); }
  attention::LinearTokens project(const at::Tensor& x) const override {
    note("project");
    return inner_.project(x);
  }
  at::Tensor project_out_gate(const at::Tensor& x) const override {
    note("project_out_gate after " + std::to_string(rec_.records().size()));
    return inner_.project_out_gate(x);
  }
  at::Tensor head_channels(int64_t h0, int64_t n) const override {
    return inner_.head_channels(h0, n);
  }
  at::Tensor convolve(const at::Tensor& qkv, const at::Tensor& halo, const at::Tensor& channels,
                      const at::Tensor& taps) const override {
    note("convolve");
    return inner_.convolve(qkv, halo, channels, taps);
  }
  attention::MixerInputs mixer_inputs(const at::Tensor& conv, const at::Tensor& beta,
                                      const at::Tensor& gate, int64_t h0,
                                      int64_t n) const override {
    return inner_.mixer_inputs(conv, beta, gate, h0, n);
  }
  attention::MixerResult mix(const attention::MixerInputs& in, bool f) const override {
    note("mix");
    return inner_.mix(in, f);
  }
  void state_summary(const attention::MixerInputs& in, at::Tensor& m,
                     at::Tensor& s) const override {
    inner_.state_summary(in, m, s);
  }
  at::Tensor output(const at::Tensor& mixed, const at::Tensor& out_gate) const override {
    note("output");
    return inner_.output(mixed, out_gate);
  }

 private:
  void note(const std::string& what) const { log.push_back(what); }
  const LinearAttentionImpl& inner_;
  const comm::CollectiveRecorder& rec_;
};

// Sync projects the output gate with the other projections, before any collective; async
// starts the exchange first and projects the gate while it travels: ulysses right after the
// seq->head all-to-all is launched (before its result is convolved), state passing once the
// halo shift and the summaries' all-gather (or the chain's first shift) are launched.
TEST(LinearCP, AsyncProjectsTheOutputGateWhileTheExchangeTravels) {
  run_ranks(2, [](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = cp::CPTopology::build(w, mesh.group_ptr({"cp"}), *cp::normalize(std::nullopt, 2));
    auto order = [&](const std::string& mode, const std::string& exchange,
                     cp::CPSchedule schedule) {
      LinearAttention m(config("kda"));
      cp::LinearCPOptions o;
      o.module_path = "l";
      o.mode = mode;
      o.state_exchange = exchange;
      o.schedule = schedule;
      cp::apply_linear_cp(m->host(), m->shape(), o, topo);
      auto& rec = *w.context().recorder;
      rec.clear();
      LoggedStages stages(*m, rec);
      auto x = at::randn({1, kS / 2, kHidden}).requires_grad_(true);
      auto y = m->host().installed()->forward(x, stages, at::Tensor());
      y.sum().backward();  // the backward of the split transfer completes
      EXPECT_TRUE(x.grad().defined());
      return stages.log;
    };
    using V = std::vector<std::string>;
    const auto sync = cp::CPSchedule::kSync, async = cp::CPSchedule::kAsync;
    EXPECT_EQ(order("ulysses", "all_gather", sync),
              (V{"project", "project_out_gate after 0", "convolve", "mix", "output"}));
    EXPECT_EQ(order("ulysses", "all_gather", async),
              (V{"project", "project_out_gate after 1", "convolve", "mix", "output"}));
    for (const std::string exchange : {"all_gather", "p2p"}) {
      EXPECT_EQ(order("state_passing", exchange, sync),
                (V{"project", "project_out_gate after 0", "convolve", "mix", "output"}));
      // The halo shift (a recv and a send), then the all-gather (one) or the first shift (two).
      const std::string launched = exchange == "p2p" ? "4" : "3";
      EXPECT_EQ(order("state_passing", exchange, async),
                (V{"project", "convolve", "mix", "project_out_gate after " + launched, "output"}));
    }
  });
}

TEST(LinearCP, FailFast) {
  run_ranks(2, [](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = cp::CPTopology::build(w, mesh.group_ptr({"cp"}), *cp::normalize(std::nullopt, 2));
    auto c = config("gdn");
    c.heads = 3;
    c.value_heads = 3;
    LinearAttention m(c);
    cp::LinearCPOptions o;
    o.module_path = "l";
    o.mode = "ulysses";
    HP_EXPECT_ERROR(cp::apply_linear_cp(m->host(), m->shape(), o, topo),
                    "mode=ulysses needs q/k heads (3) and value heads (3) divisible by cp_size=2");
    o.mode = "ring";
    HP_EXPECT_ERROR(cp::apply_linear_cp(m->host(), m->shape(), o, topo),
                    "mode='ring' is not valid; valid: ulysses, state_passing");
    o.mode = "state_passing";
    o.state_exchange = "tree";
    HP_EXPECT_ERROR(cp::apply_linear_cp(m->host(), m->shape(), o, topo),
                    "state_exchange='tree' is not valid; valid: all_gather, p2p");
    o.state_exchange = "all_gather";
    cp::apply_linear_cp(m->host(), m->shape(), o, topo);
    o.mode = "ulysses";
    c.heads = c.value_heads = 4;
    LinearAttention m2(c);
    cp::apply_linear_cp(m2->host(), m2->shape(), o, topo);
    o.mode = "state_passing";
    HP_EXPECT_ERROR(cp::apply_linear_cp(m2->host(), m2->shape(), o, topo),
                    "a different CP mode is already installed on this linear-attention layer");
    // A shard shorter than the conv halo (w - 1 = 3 rows) is refused before any collective.
    auto x = at::randn({1, 2, c.hidden});
    HP_EXPECT_ERROR(m->forward(x), "the local shard has 2 tokens, fewer than the conv halo of 3");
    // Document ids that do not describe the whole sequence (2 ranks x 8 tokens) are refused too.
    HP_EXPECT_ERROR(m->forward(at::randn({1, 8, c.hidden}), at::zeros({1, 12}, at::kLong)),
                    "doc_ids describe 12 tokens but the global sequence has 16");
  });
}

}  // namespace
}  // namespace hp::model
