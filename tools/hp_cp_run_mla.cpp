#include "hp_cp_run_mla.h"

#include <algorithm>
#include <iostream>
#include <iterator>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "hp/attention/dsa.h"
#include "hp/attention/masks.h"
#include "hp/attention/mla.h"
#include "hp/common/check.h"
#include "hp/cp/dsa.h"
#include "hp/cp/mla.h"
#include "hp/cp/sequence.h"
#include "hp_cp_run_io.h"

namespace hp_cp_run {
namespace {

constexpr InputHint kMLAHint{
    "torch.save({'q': q, 'latent': latent, 'k_rope': k_rope, 'w_ukv': w_ukv, 'dout': dout}, "
    "path)",
    "q, latent, k_rope and w_ukv (optional: dout)"};
constexpr InputHint kDSAHint{
    "torch.save({'q': q, 'latent': latent, 'k_rope': k_rope, 'w_ukv': w_ukv, 'q_index': qi, "
    "'w_index': wi, 'k_index': ki, 'dout': dout}, path)",
    "q, latent, k_rope, w_ukv, q_index, w_index and k_index (optional: dout)"};

struct MLAFile {
  at::Tensor q, latent, k_rope, w_ukv, dout;
  at::Tensor doc_ids;                    // [1, S] from --cu-seqlens, or undefined
  at::Tensor q_index, w_index, k_index;  // dsa
  hp::attention::MLAShape shape;
};

bool is_dsa(const MLAArgs& m) {
  return m.attention == "dsa";
}

MLAFile load_mla_file(const MLAArgs& m) {
  const std::string who = "hp-cp-run --attention " + m.attention;
  const auto& hint = is_dsa(m) ? kDSAHint : kMLAHint;
  HP_CHECK(!is_dsa(m) || m.strategy == "all_gather", who, ": --cp-algo '", m.strategy,
           "' is not a DSA strategy; DSA runs the all_gather family (k_I and the latent "
           "gathered): use --cp-algo all_gather");
  std::vector<std::string> known{"q", "latent", "k_rope", "w_ukv", "dout"};
  if (is_dsa(m)) known.insert(known.end(), {"q_index", "w_index", "k_index"});
  auto file = load_file(m.input, hint);
  auto dict = as_dict(file, m.input, hint);
  for (const auto& item : dict) {
    const auto key = item.key().isString() ? item.key().toStringRef() : std::string("?");
    HP_CHECK(std::find(known.begin(), known.end(), key) != known.end(), who, ": '", m.input,
             "' has an entry '", key, "' this run does not know; valid: ", hint.needs);
  }
  MLAFile f;
  f.q = entry(file, "q", m.input, hint);
  f.latent = entry(file, "latent", m.input, hint);
  f.k_rope = entry(file, "k_rope", m.input, hint);
  f.w_ukv = entry(file, "w_ukv", m.input, hint);
  if (dict.contains("dout")) f.dout = entry(file, "dout", m.input, hint);
  std::vector<const at::Tensor*> all{&f.q, &f.latent, &f.k_rope, &f.w_ukv};
  if (is_dsa(m)) {
    f.q_index = entry(file, "q_index", m.input, hint);
    f.w_index = entry(file, "w_index", m.input, hint);
    f.k_index = entry(file, "k_index", m.input, hint);
    all.insert(all.end(), {&f.q_index, &f.w_index, &f.k_index});
  }
  for (const auto* t : all) {
    HP_CHECK(t->scalar_type() == f.q.scalar_type() &&
                 (t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble),
             who, ": every tensor must be float32, or every one float64; got ",
             c10::toString(f.q.scalar_type()), " and ", c10::toString(t->scalar_type()));
  }
  f.shape = hp::attention::MLAShape::of(f.q, f.latent, f.k_rope, f.w_ukv, -1, who);
  HP_CHECK(f.latent.size(1) == f.q.size(1), who, ": latent has ", f.latent.size(1), " tokens, q ",
           f.q.size(1), "; they must match");
  if (f.dout.defined()) {
    const std::vector<int64_t> want{f.q.size(0), f.q.size(1), f.shape.heads, f.shape.d_v};
    HP_CHECK(f.dout.sizes() == at::IntArrayRef(want), who, ": dout has shape ", f.dout.sizes(),
             "; expected [B, S, H, d_v] = ", at::IntArrayRef(want));
  }
  const int64_t seq = f.q.size(1), multiple = m.load_balance ? 2 * m.cp_size : m.cp_size;
  HP_CHECK(seq % multiple == 0, who, ": the sequence length S=", seq, " is not divisible by ",
           multiple, m.load_balance ? " (2 * --cp, load balance)" : " (--cp)",
           "; pad the sequence or choose another --cp");
  if (is_dsa(m)) {
    hp::attention::DSAOptions o;
    o.topk = m.topk;
    o.loss = m.index_loss;
    hp::cp::DSACPOptions co;
    co.load_balance = m.load_balance;
    hp::cp::check_dsa_cp(who, o, co, f.q, f.latent, f.k_rope, {f.q_index, f.w_index, f.k_index}, 1);
    if (m.topk > seq) {
      std::cerr << who << ": --topk " << m.topk << " exceeds the sequence length " << seq
                << "; clamped to " << seq << " (every visible key is selected)" << std::endl;
    }
  } else {
    hp::cp::MLACPOptions o;
    o.strategy = m.strategy;
    o.load_balance = m.load_balance;
    o.primitive = m.primitive;
    hp::cp::check_mla_cp(who, o, f.shape, seq / m.cp_size, m.cp_size);
    if (!m.cu_seqlens.empty()) {
      f.doc_ids = hp::attention::document_ids_from_cu_seqlens(m.cu_seqlens, seq);
    }
  }
  return f;
}

struct RankOut {
  at::Tensor out, dq, dlatent, dk_rope, dw;
  at::Tensor indices, loss, dq_index, dw_index, dk_index;  // dsa
  int64_t bytes = 0;
};

std::vector<RankOut> run_ranks(const MLAArgs& m, const MLAFile& f) {
  const int p = m.cp_size;
  const bool backward = f.dout.defined();
  std::vector<RankOut> outs(p);
  run_cp_thread_ranks(p, [&](hp::comm::World& w, const hp::cp::CPTopology& topo) {
    const int r = w.rank();
    auto shard = [&](const at::Tensor& t) {
      return hp::cp::shard_sequence(t, 1, r, p, m.load_balance).clone().requires_grad_(backward);
    };
    auto q = shard(f.q), latent = shard(f.latent), k_rope = shard(f.k_rope);
    auto w_ukv = f.w_ukv.clone().requires_grad_(backward);
    const auto schedule = hp::cp::parse_schedule(m.schedule);
    auto& mine = outs[r];
    w.context().counters.reset();
    at::Tensor out, objective;
    hp::attention::DSAIndexer index;
    if (is_dsa(m)) {
      index = {shard(f.q_index), shard(f.w_index), shard(f.k_index)};
      hp::attention::DSAOptions o;
      o.topk = m.topk;
      o.loss = m.index_loss;
      hp::cp::DSACPOptions co;
      co.load_balance = m.load_balance;
      co.schedule = schedule;
      auto res = hp::cp::dsa_attention_cp(q, latent, k_rope, w_ukv, f.shape, index, o, co, topo);
      out = res.out;
      mine.indices = res.indices;
      mine.loss = res.loss.detach();
      objective = res.loss;
    } else {
      hp::cp::MLACPOptions o;
      o.strategy = m.strategy;
      o.load_balance = m.load_balance;
      o.schedule = schedule;
      o.primitive = m.primitive;
      out = hp::cp::mla_attention_cp([&] { return q; }, latent, k_rope, w_ukv, f.shape, o, topo,
                                     f.doc_ids);
    }
    if (backward) {
      auto dout = hp::cp::shard_sequence(f.dout, 1, r, p, m.load_balance);
      auto total = (out * dout).sum();
      if (objective.defined()) total = total + objective;
      total.backward();
      mine.dq = q.grad();
      mine.dlatent = latent.grad();
      mine.dk_rope = k_rope.grad();
      mine.dw = w_ukv.grad();
      if (is_dsa(m)) {
        mine.dq_index = index.q.grad();
        mine.dw_index = index.w.grad();
        mine.dk_index = index.k.grad();
      }
    }
    mine.bytes = w.context().counters.total_bytes();
    mine.out = out.detach();
  });
  return outs;
}

void write_results(const MLAArgs& m, const std::vector<RankOut>& outs) {
  auto whole = [&](at::Tensor RankOut::*field) {
    std::vector<at::Tensor> parts;
    for (const auto& o : outs)
      parts.push_back(o.*field);
    return hp::cp::unshard_sequence(parts, 1, m.load_balance);
  };
  c10::Dict<std::string, at::Tensor> d;
  d.insert("out", whole(&RankOut::out));
  if (is_dsa(m)) {
    d.insert("topk_indices", whole(&RankOut::indices));
    auto loss = outs[0].loss.clone();
    for (size_t r = 1; r < outs.size(); ++r)
      loss += outs[r].loss;
    d.insert("index_loss", loss);
  }
  if (outs[0].dq.defined()) {
    d.insert("dq", whole(&RankOut::dq));
    d.insert("dlatent", whole(&RankOut::dlatent));
    d.insert("dk_rope", whole(&RankOut::dk_rope));
    auto dw = outs[0].dw.clone();
    for (size_t r = 1; r < outs.size(); ++r)
      dw += outs[r].dw;
    d.insert("dw_ukv", dw);
    if (is_dsa(m)) {
      d.insert("dq_index", whole(&RankOut::dq_index));
      d.insert("dw_index", whole(&RankOut::dw_index));
      d.insert("dk_index", whole(&RankOut::dk_index));
    }
  }
  write_dict(m.output, d);
}

nlohmann::json summary(const MLAArgs& m, const MLAFile& f, const std::vector<RankOut>& outs) {
  const auto& s = f.shape;
  const int64_t b = f.q.size(0), seq = f.q.size(1), e = f.q.element_size();
  const int64_t passes = f.dout.defined() ? 2 : 1;
  std::vector<int64_t> bytes;
  for (const auto& o : outs)
    bytes.push_back(o.bytes);
  nlohmann::json j = {
      {"attention", m.attention},
      {"cp_algo", m.strategy},
      {"schedule", m.schedule},
      {"load_balance", m.load_balance},
      {"cp", m.cp_size},
      {"batch", b},
      {"seq", seq},
      {"heads", s.heads},
      {"d_nope", s.d_nope},
      {"d_rope", s.d_rope},
      {"d_v", s.d_v},
      {"kv_rank", s.kv_rank},
      {"backward", f.dout.defined()},
      {"documents", f.doc_ids.defined() ? static_cast<int64_t>(m.cu_seqlens.size()) - 1 : 0},
      {"comm_bytes_per_rank", bytes}};
  if (is_dsa(m)) {
    const int64_t d_i = f.k_index.size(2);
    j["topk"] = std::min(m.topk, seq);
    j["index_loss_variant"] = m.index_loss;
    j["index_heads"] = f.q_index.size(2);
    j["index_dim"] = d_i;
    double loss = 0;
    for (const auto& o : outs)
      loss += o.loss.item<double>();
    j["index_loss"] = loss;
    j["comm_bytes_theory"] =
        m.cp_size > 1 ? passes * hp::cp::dsa_forward_bytes_per_rank(s, d_i, b, seq, m.cp_size, e)
                      : 0;
  } else {
    j["comm_bytes_theory"] =
        passes * hp::cp::mla_forward_bytes_per_rank(m.strategy, s, b, seq, m.cp_size, e);
    j["expanded_kv_gather_bytes_theory"] =
        passes * hp::cp::mla_expanded_gather_bytes_per_rank(s, b, seq, m.cp_size, e);
  }
  return j;
}

}  // namespace

int run_mla(const MLAArgs& m) {
  check_output(m.output);
  hp::cp::parse_schedule(m.schedule);
  const auto f = load_mla_file(m);
  const auto outs = run_ranks(m, f);
  write_results(m, outs);
  std::cout << summary(m, f, outs).dump() << std::endl;
  return 0;
}

}  // namespace hp_cp_run
