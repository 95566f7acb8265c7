#include "hp_cp_run_mixer.h"

#include <algorithm>
#include <functional>
#include <iostream>
#include <iterator>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/attention/delta_rule.h"
#include "hp/attention/linear_host.h"
#include "hp/attention/masks.h"
#include "hp/common/check.h"
#include "hp/common/shape.h"
#include "hp/cp/linear_mixer.h"
#include "hp/cp/topology.h"
#include "hp_cp_run_io.h"

namespace hp_cp_run {
namespace {

constexpr InputHint kMixerHint{
    "torch.save({'q': q, 'k': k, 'v': v, 'g': g, 'beta': beta, 'dout': dout}, path)",
    "q, k, v, g and beta (optional: initial_state, dout, dfinal_state)"};
constexpr const char* kEntries[] = {"q",           "k", "v", "g", "beta", "dout", "initial_state",
                                    "dfinal_state"};

// The whole-sequence tensors of --input, checked.
struct MixerFile {
  hp::attention::MixerInputs in;
  at::Tensor dout, dfinal;
  hp::attention::MixerShape shape;
  hp::attention::GateKind gate = hp::attention::GateKind::kPerHead;
};

MixerFile load_mixer_file(const MixerArgs& m) {
  const std::string who = "hp-cp-run --mixer " + m.mixer;
  HP_CHECK(m.mixer == "gdn" || m.mixer == "kda", "hp-cp-run: --mixer '", m.mixer,
           "' is not valid; valid: gdn, kda");
  auto file = load_file(m.input, kMixerHint);
  auto dict = as_dict(file, m.input, kMixerHint);
  for (const auto& item : dict) {
    const auto key = item.key().isString() ? item.key().toStringRef() : std::string("?");
    HP_CHECK(std::find(std::begin(kEntries), std::end(kEntries), key) != std::end(kEntries), who,
             ": '", m.input, "' has an entry '", key,
             "' this run does not know; valid: q, k, v, g, beta, initial_state, dout, "
             "dfinal_state");
  }
  auto optional = [&](const std::string& key) {
    return dict.contains(key) ? entry(file, key, m.input, kMixerHint) : at::Tensor();
  };
  MixerFile f;
  f.gate =
      m.mixer == "kda" ? hp::attention::GateKind::kPerChannel : hp::attention::GateKind::kPerHead;
  for (auto [key, t] : {std::pair<const char*, at::Tensor*>{"q", &f.in.q},
                        {"k", &f.in.k},
                        {"v", &f.in.v},
                        {"g", &f.in.g},
                        {"beta", &f.in.beta}}) {
    *t = entry(file, key, m.input, kMixerHint);
  }
  f.in.initial_state = optional("initial_state");
  f.dout = optional("dout");
  f.dfinal = optional("dfinal_state");
  hp::attention::MixerOptions o;
  o.scale = m.scale;
  o.chunk_size = m.chunk_size;
  if (!m.cu_seqlens.empty()) {  // document starts from the boundaries (checked there)
    auto ids = hp::attention::document_ids_from_cu_seqlens(m.cu_seqlens, f.in.q.size(1));
    f.in.resets = hp::attention::linear_documents(ids, 0, ids.size(1), 1)
                      .resets.expand({f.in.q.size(0), ids.size(1)})
                      .contiguous();
  }
  f.shape = hp::attention::validate_mixer_inputs(f.in, o, f.gate, true, who);
  const auto& s = f.shape;
  if (f.dout.defined()) {
    HP_CHECK(f.dout.sizes() == f.in.v.sizes(), who, ": dout has shape ",
             hp::common::shape_str(f.dout.sizes()), "; it must be shaped like v ",
             hp::common::shape_str(f.in.v.sizes()));
  }
  if (f.dfinal.defined()) {
    HP_CHECK(f.dout.defined(), who,
             ": dfinal_state is given without dout; add dout (zeros "
             "for a gradient of the final state alone)");
    const std::vector<int64_t> want{s.batch, s.value_heads, s.key_dim, s.value_dim};
    HP_CHECK(f.dfinal.sizes() == at::IntArrayRef(want), who, ": dfinal_state has shape ",
             hp::common::shape_str(f.dfinal.sizes()),
             "; expected [B, HV, K, V] = ", hp::common::shape_str(want));
  }
  HP_CHECK(s.tokens % m.cp_size == 0, who, ": the sequence length T=", s.tokens,
           " (q.size(1)) is not divisible by --cp ", m.cp_size,
           "; use a --cp that divides it or pad the sequence");
  hp::cp::check_linear_cp_mode(who, m.mode, m.exchange, s.heads, s.value_heads, m.cp_size);
  return f;
}

// One rank's results: its shards (and state gradient part), the bytes it sent.
struct RankOut {
  at::Tensor out, final_state, dh0;
  std::vector<at::Tensor> grads;  // dq, dk, dv, dg, dbeta (shards)
  int64_t bytes = 0;
};

std::vector<RankOut> run_ranks(const MixerArgs& m, const MixerFile& f) {
  const int p = m.cp_size;
  const int64_t len = f.shape.tokens / p;
  const bool backward = f.dout.defined();
  std::vector<RankOut> outs(p);
  run_cp_thread_ranks(p, [&](hp::comm::World& w, const hp::cp::CPTopology& topo) {
    const int r = w.rank();
    auto shard = f.in;
    for (auto* t : {&shard.q, &shard.k, &shard.v, &shard.g, &shard.beta}) {
      *t = t->narrow(1, r * len, len).clone().requires_grad_(backward);
    }
    if (shard.initial_state.defined()) {
      shard.initial_state = shard.initial_state.clone().requires_grad_(backward);
    }
    if (shard.resets.defined()) shard.resets = shard.resets.narrow(1, r * len, len);
    hp::attention::MixerOptions o;
    o.scale = m.scale;
    o.chunk_size = m.chunk_size;
    o.output_final_state = true;
    hp::cp::LinearMixerCPOptions cp;
    cp.mode = m.mode;
    cp.state_exchange = m.exchange;
    w.context().counters.reset();
    auto res = hp::cp::linear_mixer_cp(shard, o, f.gate, cp, topo);
    auto& mine = outs[r];
    if (backward) {
      // The loss is the sum of the ranks' losses: the final state's gradient enters on
      // rank 0 only (zeros elsewhere, so every rank runs the same backward).
      auto dfinal = f.dfinal.defined() && r == 0 ? f.dfinal.to(res.final_state.scalar_type())
                                                 : at::zeros_like(res.final_state);
      torch::autograd::backward({res.out, res.final_state},
                                {f.dout.narrow(1, r * len, len), dfinal});
      for (auto* t : {&shard.q, &shard.k, &shard.v, &shard.g, &shard.beta})
        mine.grads.push_back(t->grad());
      if (shard.initial_state.defined()) {
        mine.dh0 = shard.initial_state.grad();
        if (!mine.dh0.defined()) mine.dh0 = at::zeros_like(shard.initial_state);
      }
    }
    mine.bytes = w.context().counters.total_bytes();
    mine.out = res.out.detach();
    mine.final_state = res.final_state.detach();
  });
  return outs;
}

void write_results(const MixerArgs& m, const std::vector<RankOut>& outs) {
  auto cat = [&](const std::function<at::Tensor(const RankOut&)>& field) {
    std::vector<at::Tensor> parts;
    parts.reserve(outs.size());
    for (const auto& o : outs)
      parts.push_back(field(o));
    return at::cat(parts, 1);
  };
  c10::Dict<std::string, at::Tensor> d;
  d.insert("out", cat([](const RankOut& o) { return o.out; }));
  d.insert("final_state", outs[0].final_state);  // the same on every rank
  if (!outs[0].grads.empty()) {
    const char* names[] = {"dq", "dk", "dv", "dg", "dbeta"};
    for (size_t i = 0; i < 5; ++i)
      d.insert(names[i], cat([i](const RankOut& o) { return o.grads[i]; }));
  }
  if (outs[0].dh0.defined()) {
    auto total = outs[0].dh0.clone();
    for (size_t r = 1; r < outs.size(); ++r)
      total += outs[r].dh0;
    d.insert("dinitial_state", total);
  }
  write_dict(m.output, d);
}

nlohmann::json summary(const MixerArgs& m, const MixerFile& f, const std::vector<RankOut>& outs) {
  const auto& s = f.shape;
  hp::cp::LinearMixerCPOptions cp;
  cp.mode = m.mode;
  cp.state_exchange = m.exchange;
  const bool backward = f.dout.defined();
  const auto sizes = hp::cp::LinearMixerElementSizes::of(f.in);
  // The resets' all-gather (ulysses) is in the forward only.
  const int64_t theory =
      hp::cp::linear_mixer_forward_bytes_per_rank(s, f.gate, cp, m.cp_size, sizes, true,
                                                  f.in.resets.defined()) +
      (backward ? hp::cp::linear_mixer_forward_bytes_per_rank(s, f.gate, cp, m.cp_size, sizes, true)
                : 0);
  std::vector<int64_t> bytes;
  bytes.reserve(outs.size());
  for (const auto& o : outs)
    bytes.push_back(o.bytes);
  nlohmann::json j = {{"mixer", m.mixer},
                      {"cp_mode", m.mode},
                      {"cp", m.cp_size},
                      {"batch", s.batch},
                      {"seq", s.tokens},
                      {"heads", s.heads},
                      {"value_heads", s.value_heads},
                      {"key_dim", s.key_dim},
                      {"value_dim", s.value_dim},
                      {"scale", s.scale},
                      {"chunk_size", m.chunk_size},
                      {"initial_state", f.in.initial_state.defined()},
                      {"documents", m.cu_seqlens.empty() ? 0 : m.cu_seqlens.size() - 1},
                      {"backward", backward},
                      {"comm_bytes_per_rank", bytes},
                      {"comm_bytes_theory", theory},
                      {"comm_bytes_theory_per_rank", std::vector<int64_t>(m.cp_size, theory)}};
  if (m.mode == "state_passing") j["state_exchange"] = m.exchange;
  return j;
}

}  // namespace

void add_mixer_options(CLI::App& app, MixerArgs& m) {
  app.add_option("--mixer", m.mixer, "gdn | kda: a linear-attention mixer instead of attention");
  app.add_option("--cp-mode", m.mode, "--mixer: ulysses | state_passing");
  app.add_option("--state-exchange", m.exchange, "--mixer, state_passing: all_gather | p2p");
  app.add_option("--scale", m.scale, "--mixer: query scale (default 1/sqrt(K))");
  app.add_option("--chunk-size", m.chunk_size, "--mixer: tokens per chunk of the chunked kernel")
      ->check(CLI::PositiveNumber);
}

bool mixer_requested(const CLI::App& app, const MixerArgs& m) {
  const bool mixer = app.count("--mixer") > 0;
  for (const char* flag : {"--cp-mode", "--state-exchange", "--scale", "--chunk-size"}) {
    HP_CHECK(mixer || app.count(flag) == 0, "hp-cp-run: ", flag,
             " applies to a linear-attention mixer only; add --mixer gdn|kda");
  }
  for (const char* flag :
       {"--cp-algo", "--ulysses-degree", "--schedule", "--load-balance", "--load-balance-form",
        "--causal", "--layout", "--primitive", "--adapter", "--kv-head-policy",
        "--ulysses-head-groups", "--ulysses-row-parts", "--ring-keep-blocks", "--ring-backward"}) {
    HP_CHECK(!mixer || app.count(flag) == 0, "hp-cp-run: ", flag,
             " applies to attention, not to --mixer ", m.mixer,
             "; drop it (a mixer run takes --cp-mode, --state-exchange, --scale, --chunk-size)");
  }
  return mixer;
}

int run_mixer(const MixerArgs& m) {
  check_output(m.output);
  const auto f = load_mixer_file(m);
  const auto outs = run_ranks(m, f);
  write_results(m, outs);
  std::cout << summary(m, f, outs).dump() << std::endl;
  return 0;
}

}  // namespace hp_cp_run
