#include "hp_cp_run_mla.h"

#include <algorithm>
#include <iostream>
#include <iterator>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "hp/attention/mla.h"
#include "hp/comm/device_mesh.h"
#include "hp/comm/local_ranks.h"
#include "hp/common/check.h"
#include "hp/cp/mla.h"
#include "hp/cp/sequence.h"
#include "hp_cp_run_io.h"

namespace hp_cp_run {
namespace {

constexpr InputHint kMLAHint{
    "torch.save({'q': q, 'latent': latent, 'k_rope': k_rope, 'w_ukv': w_ukv, 'dout': dout}, "
    "path)",
    "q, latent, k_rope and w_ukv (optional: dout)"};
constexpr const char* kEntries[] = {"q", "latent", "k_rope", "w_ukv", "dout"};

struct MLAFile {
  at::Tensor q, latent, k_rope, w_ukv, dout;
  hp::attention::MLAShape shape;
};

MLAFile load_mla_file(const MLAArgs& m) {
  const std::string who = "hp-cp-run --attention mla";
  auto file = load_file(m.input, kMLAHint);
  auto dict = as_dict(file, m.input, kMLAHint);
  for (const auto& item : dict) {
    const auto key = item.key().isString() ? item.key().toStringRef() : std::string("?");
    HP_CHECK(std::find(std::begin(kEntries), std::end(kEntries), key) != std::end(kEntries), who,
             ": '", m.input, "' has an entry '", key,
             "' this run does not know; valid: q, latent, k_rope, w_ukv, dout");
  }
  MLAFile f;
  f.q = entry(file, "q", m.input, kMLAHint);
  f.latent = entry(file, "latent", m.input, kMLAHint);
  f.k_rope = entry(file, "k_rope", m.input, kMLAHint);
  f.w_ukv = entry(file, "w_ukv", m.input, kMLAHint);
  if (dict.contains("dout")) f.dout = entry(file, "dout", m.input, kMLAHint);
  for (const auto* t : {&f.q, &f.latent, &f.k_rope, &f.w_ukv}) {
    HP_CHECK(t->scalar_type() == f.q.scalar_type() &&
                 (t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble),
             who, ": q, latent, k_rope and w_ukv must all be float32 or all float64; got ",
             c10::toString(f.q.scalar_type()), " and ", c10::toString(t->scalar_type()));
  }
  f.shape = hp::attention::MLAShape::of(f.q, f.latent, f.k_rope, f.w_ukv, -1, who);
  HP_CHECK(f.latent.size(1) == f.q.size(1), who, ": latent has ", f.latent.size(1),
           " tokens, q ", f.q.size(1), "; they must match");
  if (f.dout.defined()) {
    const std::vector<int64_t> want{f.q.size(0), f.q.size(1), f.shape.heads, f.shape.d_v};
    HP_CHECK(f.dout.sizes() == at::IntArrayRef(want), who, ": dout has shape ", f.dout.sizes(),
             "; expected [B, S, H, d_v] = ", at::IntArrayRef(want));
  }
  const int64_t seq = f.q.size(1), multiple = m.load_balance ? 2 * m.cp_size : m.cp_size;
  HP_CHECK(seq % multiple == 0, who, ": the sequence length S=", seq, " is not divisible by ",
           multiple, m.load_balance ? " (2 * --cp, load balance)" : " (--cp)",
           "; pad the sequence or choose another --cp");
  hp::cp::MLACPOptions o;
  o.strategy = m.strategy;
  o.load_balance = m.load_balance;
  o.primitive = m.primitive;
  hp::cp::check_mla_cp(who, o, f.shape, seq / m.cp_size, m.cp_size);
  return f;
}

struct RankOut {
  at::Tensor out, dq, dlatent, dk_rope, dw;
  int64_t bytes = 0;
};

std::vector<RankOut> run_ranks(const MLAArgs& m, const MLAFile& f) {
  const int p = m.cp_size;
  const bool backward = f.dout.defined();
  std::vector<RankOut> outs(p);
  hp::comm::WorldOptions wo;
  wo.timeout = std::chrono::seconds(120);
  hp::comm::run_thread_ranks(
      p,
      [&](hp::comm::World& w) {
        hp::comm::DeviceMesh mesh(w, {{"cp", p}});
        auto topo = hp::cp::CPTopology::build(
            w, mesh.group_ptr({"cp"}),
            hp::cp::normalize(std::nullopt, p).value_or(hp::cp::ContextParallelConfig{}));
        const int r = w.rank();
        auto shard = [&](const at::Tensor& t) {
          return hp::cp::shard_sequence(t, 1, r, p, m.load_balance)
              .contiguous()
              .requires_grad_(backward);
        };
        auto q = shard(f.q), latent = shard(f.latent), k_rope = shard(f.k_rope);
        auto w_ukv = f.w_ukv.clone().requires_grad_(backward);
        hp::cp::MLACPOptions o;
        o.strategy = m.strategy;
        o.load_balance = m.load_balance;
        o.schedule = hp::cp::parse_schedule(m.schedule);
        o.primitive = m.primitive;
        w.context().counters.reset();
        auto out = hp::cp::mla_attention_cp([&] { return q; }, latent, k_rope, w_ukv, f.shape, o,
                                            *topo);
        auto& mine = outs[r];
        if (backward) {
          out.backward(hp::cp::shard_sequence(f.dout, 1, r, p, m.load_balance));
          mine.dq = q.grad();
          mine.dlatent = latent.grad();
          mine.dk_rope = k_rope.grad();
          mine.dw = w_ukv.grad();
        }
        mine.bytes = w.context().counters.total_bytes();
        mine.out = out.detach();
      },
      wo);
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
  if (outs[0].dq.defined()) {
    d.insert("dq", whole(&RankOut::dq));
    d.insert("dlatent", whole(&RankOut::dlatent));
    d.insert("dk_rope", whole(&RankOut::dk_rope));
    auto dw = outs[0].dw.clone();
    for (size_t r = 1; r < outs.size(); ++r)
      dw += outs[r].dw;
    d.insert("dw_ukv", dw);
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
  return {{"attention", "mla"},
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
          {"comm_bytes_per_rank", bytes},
          {"comm_bytes_theory",
           passes * hp::cp::mla_forward_bytes_per_rank(m.strategy, s, b, seq, m.cp_size, e)},
          {"expanded_kv_gather_bytes_theory",
           passes * hp::cp::mla_expanded_gather_bytes_per_rank(s, b, seq, m.cp_size, e)}};
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
