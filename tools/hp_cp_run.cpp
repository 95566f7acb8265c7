// hp-cp-run: one CP attention forward/backward over P ranks (threads in this process) on
// full-sequence tensors from a torch.save file; writes full-sequence results loadable by
// torch.load. For debugging and cross-checking against PyTorch.
//
//   hp-cp-run --input IN.pt --output OUT.pt --cp P --cp-algo all_gather|ulysses|hybrid|ring|usp
//     [--ulysses-degree U] [--schedule sync|async] [--load-balance] [--causal]
//     [--layout bnsd|bshd] [--primitive math|blockwise] [--adapter sdpa_qkv|...]
//     [--kv-head-policy error|repeat] [--cu-seqlens 0,L1,L1+L2,...]
// --cu-seqlens: packed documents, global boundaries shared by every batch row (attention stays
// inside each document; positions past the last boundary form one more document).
// IN.pt: dict with q, k, v, dout. OUT.pt: dict with out, dq, dk, dv (natural order).
//
// A linear-attention mixer under CP instead (hp_cp_run_mixer.h; --cp-algo and the attention
// flags do not apply):
//   hp-cp-run --input IN.pt --output OUT.pt --cp P --mixer gdn|kda
//     [--cp-mode ulysses|state_passing] [--state-exchange all_gather|p2p] [--scale S]
//     [--chunk-size C] [--cu-seqlens 0,L1,L1+L2,...]   (the state restarts at each document)
//
// MLA's core under CP instead (hp_cp_run_mla.h):
//   hp-cp-run --input IN.pt --output OUT.pt --cp P --attention mla
//     [--cp-algo latent_all_gather|ulysses|all_gather] [--schedule sync|async] [--load-balance]
//   hp-cp-run --input IN.pt --output OUT.pt --cp P --attention dsa [--topk N]
//     [--index-loss sparse|dense] [--schedule sync|async] [--load-balance]
#include <algorithm>
#include <iostream>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/bench/cp_layer.h"
#include "hp/comm/device_mesh.h"
#include "hp/comm/local_ranks.h"
#include "hp/common/check.h"
#include "hp/common/host_allocator.h"
#include "hp/common/shape.h"
#include "hp/common/strings.h"
#include "hp/cp/adapter.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "hp/cp/strategy.h"
#include "hp/cp/volume.h"
#include "hp_cp_run_io.h"
#include "hp_cp_run_mixer.h"
#include "hp_cp_run_mla.h"

namespace {

// The CP flags (--cp-algo, --schedule, ...) are the base's.
struct Args : hp::cp::CPFlags {
  std::string input, output, layout = "bnsd";
  std::string primitive = "blockwise", adapter = "sdpa_qkv";
  int cp_size = 2;
  bool causal = false;
  std::string lb_form;  // empty: the strategy's form (all_gather: swap; the others: data_order)
  std::vector<int64_t> cu_seqlens;  // empty: no documents
};

void add_options(CLI::App& app, Args& a) {
  app.add_option("--input", a.input, "torch.save dict with q, k, v, dout")->required();
  app.add_option("--output", a.output, "where to write out, dq, dk, dv")->required();
  app.add_option("--cp,--nproc", a.cp_size, "CP ranks (threads)")->check(CLI::Range(1, 64));
  app.add_option("--cp-algo", a.algo, hp::cp::StrategyRegistry::builtin().names_list(" | "));
  app.add_option("--ulysses-degree", a.degree,
                 "Ulysses degree (hybrid, usp: required; ulysses: the whole CP group)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--schedule", a.schedule, "sync | async");
  app.add_flag("--load-balance", a.load_balance,
               "head-tail load balance (all_gather, hybrid, ring, usp)");
  app.add_option("--load-balance-form", a.lb_form,
                 "runtime_swap (contiguous shards, Q halves swapped) | data_order (shards "
                 "made by shard_sequence); default: runtime_swap for all_gather, else data_order");
  app.add_flag("--causal", a.causal, "causal attention");
  app.add_option("--layout", a.layout, "bnsd | bshd");
  app.add_option("--kv-head-policy", a.kv_head_policy,
                 "error | repeat: K/V heads fewer than the Ulysses degree sent once and repeated "
                 "after the exchange");
  app.add_option("--primitive", a.primitive, "math | blockwise");
  app.add_option("--ulysses-head-groups", a.head_groups,
                 "async ulysses, hybrid: Q/K/V and output all-to-alls (hybrid: and co-group K/V "
                 "gathers) per head group, pipelined with the groups' attention; usp: output "
                 "all-to-alls per group; all_gather: K/V gathers per group (0: auto)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ulysses-row-parts", a.row_parts,
                 "async ulysses: the last head group's output all-to-all in this many row parts, "
                 "each sent while the next is attended (0: automatic, 2 where each part keeps "
                 "2048 rows; 1: whole)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--ring-keep-blocks", a.ring_keep_blocks,
               "ring, usp: keep the K/V blocks from forward, so backward sends only the dK/dV "
               "accumulators (all_gather's bytes and memory)");
  app.add_option("--ring-backward", a.ring_backward,
                 "ring, usp: what the backward passes around the ring: auto | blocks | queries");
  app.add_option("--cu-seqlens", a.cu_seqlens,
                 "packed documents: global boundaries 0,L1,L1+L2,... (the same for every row)")
      ->delimiter(',');
  app.add_option("--adapter", a.adapter, hp::cp::AdapterRegistry::builtin().names_list(" | "));
}

// The checked layout and CP configuration (normalised for --cp ranks).
hp::cp::ContextParallelConfig resolve_config(const Args& a) {
  HP_CHECK(a.layout == "bnsd" || a.layout == "bshd", "hp-cp-run: --layout '", a.layout,
           "' is not valid; valid: bnsd, bshd");
  auto c = hp::cp::parse_flags(a);
  if (a.cp_size == 1) {  // the plain primitive runs: no CP flag would do anything
    auto given = hp::cp::settings_given(c);
    if (!a.lb_form.empty()) given.push_back("--load-balance-form " + a.lb_form);
    if (a.adapter != Args().adapter) given.push_back("--adapter " + a.adapter);
    hp::cp::check_nothing_given_without_cp("hp-cp-run", given,
                                           "the plain primitive runs on the whole sequence");
  }
  HP_CHECK(a.lb_form.empty() || a.load_balance, "hp-cp-run: --load-balance-form ", a.lb_form,
           " chooses how --load-balance shards; add --load-balance or drop it");
  // all_gather balances contiguous shards by swapping; every other balanced strategy
  // (hybrid, ring, usp) balances data-order shards only.
  const std::string form = !a.lb_form.empty()       ? a.lb_form
                           : a.algo == "all_gather" ? "runtime_swap"
                                                    : "data_order";
  HP_CHECK(form == "runtime_swap" || form == "data_order", "hp-cp-run: --load-balance-form '", form,
           "' is not valid; valid: runtime_swap, data_order");
  c.load_balance_form = form == "data_order" ? hp::cp::LoadBalanceForm::kDataOrder
                                             : hp::cp::LoadBalanceForm::kRuntimeSwap;
  return hp::cp::normalize(c, a.cp_size).value_or(hp::cp::ContextParallelConfig{});
}

bool data_order(const hp::cp::ContextParallelConfig& config) {
  return config.load_balance && config.load_balance_form == hp::cp::LoadBalanceForm::kDataOrder;
}

constexpr hp_cp_run::InputHint kAttentionHint{
    "torch.save({'q': q, 'k': k, 'v': v, 'dout': dout}, path)", "q, k, v and dout"};

at::Tensor entry(const c10::IValue& file, const std::string& key, const std::string& path) {
  return hp_cp_run::entry(file, key, path, kAttentionHint);
}

// The full-sequence tensors of --input and where their sequence and head dims are.
struct Inputs {
  at::Tensor q, k, v, dout;
  at::Tensor doc_ids;         // [1, S] from --cu-seqlens, or undefined
  int64_t seq = 2, head = 1;  // BNSD; BSHD: 1, 2
};

Inputs load_inputs(const Args& a, const hp::cp::ContextParallelConfig& config) {
  const bool bshd = a.layout == "bshd";
  auto in = hp_cp_run::load_file(a.input, kAttentionHint);
  Inputs x;
  x.q = entry(in, "q", a.input);
  x.k = entry(in, "k", a.input);
  x.v = entry(in, "v", a.input);
  x.dout = entry(in, "dout", a.input);
  x.seq = bshd ? 1 : 2;
  x.head = bshd ? 2 : 1;
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"q", x.q},
                                {"k", x.k},
                                {"v", x.v},
                                {"dout", x.dout}}) {
    HP_CHECK(t.dim() == 4, "hp-cp-run: '", a.input, "': ", name, " must be 4-d (", a.layout,
             "), got ", t.dim(), " dims");
    HP_CHECK(t.is_floating_point() && t.scalar_type() == x.q.scalar_type(), "hp-cp-run: '", a.input,
             "': ", name, " is ", t.scalar_type(),
             "; q, k, v and dout must share one "
             "floating dtype (q is ",
             x.q.scalar_type(), ")");
  }
  {
    // dout is the output's gradient: q's shape with v's per-head size.
    auto want = x.q.sizes().vec();
    want[3] = x.v.size(3);
    HP_CHECK(x.dout.sizes().vec() == want, "hp-cp-run: '", a.input, "': dout is ",
             hp::common::shape_str(x.dout.sizes()), " but the output is ",
             hp::common::shape_str(want), " (q's shape with v's last dim)");
  }
  hp::cp::check_sequence(config, a.cp_size, x.q.size(x.seq));
  hp::cp::check_heads(config, a.cp_size, x.q.size(x.head), x.k.size(x.head));
  if (!a.cu_seqlens.empty()) {
    x.doc_ids = hp::attention::document_ids_from_cu_seqlens(a.cu_seqlens, x.q.size(x.seq));
  }
  return x;
}

// No CP: the plain primitive on the full tensors.
hp::bench::CPLayerResult run_plain(const Args& a, const Inputs& x) {
  hp::attention::CoreAttentionOptions co;
  co.attention.causal = a.causal;
  if (x.doc_ids.defined()) co.attention.documents = hp::attention::Documents{x.doc_ids};
  co.primitive = a.primitive;
  co.seq_dim = x.seq;
  co.heads_dim = x.head;
  hp::attention::CoreAttention core(co);
  auto q1 = x.q.detach().requires_grad_(true), k1 = x.k.detach().requires_grad_(true),
       v1 = x.v.detach().requires_grad_(true);
  auto out = core.forward(q1, k1, v1);
  out.backward(x.dout);
  return {out.detach(), q1.grad(), k1.grad(), v1.grad()};
}

// What every rank thread produced: its shards, the bytes it sent and rank 0's apply log.
struct RankResults {
  std::vector<hp::bench::CPLayerResult> results;
  std::vector<int64_t> bytes;
  std::string log;
};

RankResults run_ranks(const Args& a, const hp::cp::ContextParallelConfig& config, const Inputs& x) {
  hp::bench::CPLayerOptions lo;
  lo.config = config;
  lo.adapter = a.adapter;
  lo.causal = a.causal;
  lo.bshd = a.layout == "bshd";
  lo.primitive = a.primitive;
  lo.doc_ids = x.doc_ids;
  RankResults rr{
      std::vector<hp::bench::CPLayerResult>(a.cp_size), std::vector<int64_t>(a.cp_size), {}};
  hp::comm::WorldOptions wo;
  wo.timeout = std::chrono::seconds(120);
  hp::comm::run_thread_ranks(
      a.cp_size,
      [&](hp::comm::World& w) {
        hp::comm::DeviceMesh mesh(w, {{"cp", a.cp_size}});
        const int r = w.rank();
        auto part = [&](const at::Tensor& t) {
          return hp::cp::shard_sequence(t, x.seq, r, a.cp_size, data_order(config));
        };
        if (a.cp_size == 1) {
          rr.results[r] = run_plain(a, x);
          return;
        }
        hp::bench::CPAttentionLayer layer(w, mesh.group_ptr({"cp"}), lo);
        w.context().counters.reset();
        rr.results[r] = layer.run(part(x.q), part(x.k), part(x.v), part(x.dout));
        rr.bytes[r] = w.context().counters.total_bytes();
        if (r == 0) rr.log = layer.apply_log();
      },
      wo);
  return rr;
}

// The full-sequence results in natural order into --output (temp file + rename).
void write_output(const Args& a, const hp::cp::ContextParallelConfig& config, const Inputs& x,
                  const std::vector<hp::bench::CPLayerResult>& results) {
  auto cat = [&](at::Tensor hp::bench::CPLayerResult::*field) {
    std::vector<at::Tensor> parts;
    for (auto& res : results)
      parts.push_back(res.*field);
    return hp::cp::unshard_sequence(parts, x.seq, data_order(config));  // natural order
  };
  c10::Dict<std::string, at::Tensor> out;
  out.insert("out", cat(&hp::bench::CPLayerResult::out));
  out.insert("dq", cat(&hp::bench::CPLayerResult::dq));
  out.insert("dk", cat(&hp::bench::CPLayerResult::dk));
  out.insert("dv", cat(&hp::bench::CPLayerResult::dv));
  hp_cp_run::write_dict(a.output, out);
}

// The one-line JSON summary: configuration, counted bytes and the formula's.
nlohmann::json summary(const Args& a, const hp::cp::ContextParallelConfig& config, const Inputs& x,
                       const std::vector<int64_t>& bytes) {
  const auto& q = x.q;
  hp::cp::AttentionShape shape{q.size(x.seq),    q.size(x.head),
                               x.k.size(x.head), q.size(3),
                               q.size(0),        static_cast<int64_t>(q.element_size())};
  shape.causal = a.causal;
  shape.v_dim = x.v.size(3);
  std::vector<int64_t> theory_per_rank(a.cp_size, 0);
  for (int r = 0; a.cp_size > 1 && r < a.cp_size; ++r) {
    theory_per_rank[r] = hp::cp::step_bytes_per_rank(config, a.cp_size, shape, r);
  }
  // The busiest rank's (ranks differ where a causal ring's chunks stop early), as hp-bench's.
  const int64_t theory = *std::max_element(theory_per_rank.begin(), theory_per_rank.end());
  return {{"algorithm", hp::cp::to_string(config.algorithm)},
          {"cp", a.cp_size},
          {"ulysses_degree", hp::cp::ulysses_degree_of(config, a.cp_size)},
          {"adapter", a.adapter},
          {"load_balance", config.load_balance},
          {"schedule", hp::cp::to_string(config.schedule)},
          {"documents", x.doc_ids.defined() ? static_cast<int64_t>(a.cu_seqlens.size()) - 1 : 0},
          {"comm_bytes_per_rank", bytes},
          {"comm_bytes_theory", theory},
          {"comm_bytes_theory_per_rank", theory_per_rank}};
}

int run(const Args& a) {
  hp_cp_run::check_output(a.output);
  const auto config = resolve_config(a);
  const auto inputs = load_inputs(a, config);
  const auto ranks = run_ranks(a, config, inputs);
  write_output(a, config, inputs, ranks.results);
  const auto j = summary(a, config, inputs, ranks.bytes);
  if (!ranks.log.empty()) std::cerr << ranks.log << std::endl;
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hp-cp-run: one CP attention forward/backward on tensors from a torch.save file"};
  Args a;
  add_options(app, a);
  hp_cp_run::MixerArgs m;
  hp_cp_run::add_mixer_options(app, m);
  std::string attention = "softmax", host_allocator = "caching";
  app.add_option("--host-allocator", host_allocator, hp::common::kHostAllocatorHelp)
      ->check(CLI::IsMember(hp::common::host_allocator_choices()));
  app.add_option("--attention", attention,
                 "softmax (q, k, v) | mla (q, latent, k_rope, w_ukv; causal) | dsa (mla + "
                 "q_index, w_index, k_index)");
  int64_t topk = 2048;
  std::string index_loss = "sparse";
  app.add_option("--topk", topk, "dsa: keys each query attends (clamped to S)")
      ->check(CLI::PositiveNumber);
  app.add_option("--index-loss", index_loss, "dsa: sparse | dense (indexer warm-up)");
  CLI11_PARSE(app, argc, argv);
  try {
    hp::common::apply_host_allocator_choice(host_allocator);
    HP_CHECK(attention == "softmax" || attention == "mla" || attention == "dsa",
             "hp-cp-run: --attention '", attention, "' is not valid; valid: softmax, mla, dsa");
    for (const char* flag : {"--topk", "--index-loss"}) {
      HP_CHECK(attention == "dsa" || app.count(flag) == 0, "hp-cp-run: ", flag,
               " applies to --attention dsa");
    }
    if (attention != "softmax") {
      for (const char* flag : {"--ulysses-degree", "--load-balance-form", "--layout", "--adapter",
                               "--mixer", "--kv-head-policy", "--ulysses-head-groups",
                               "--ulysses-row-parts", "--ring-keep-blocks", "--ring-backward",
                               "--cp-mode", "--state-exchange", "--scale", "--chunk-size"}) {
        HP_CHECK(app.count(flag) == 0, "hp-cp-run: ", flag, " does not apply to --attention ",
                 attention,
                 "; drop it (MLA takes --cp-algo latent_all_gather|ulysses|all_gather and "
                 "--cu-seqlens, DSA --cp-algo all_gather; both --schedule, --load-balance)");
      }
      HP_CHECK(attention == "mla" || a.cu_seqlens.empty(),
               "hp-cp-run: --cu-seqlens does not apply to --attention dsa (the DSA indexer takes "
               "no document boundaries yet); drop it or use --attention mla");
      HP_CHECK(attention != "dsa" || app.count("--primitive") == 0,
               "hp-cp-run: --primitive does not apply to --attention dsa (its sparse kernel is "
               "its own); drop it");
      if (a.cp_size == 1) {  // the plain layer runs: no CP flag would do anything
        std::vector<std::string> given;
        if (app.count("--cp-algo") > 0) given.push_back("--cp-algo " + a.algo);
        if (a.schedule != "sync") given.push_back("--schedule " + a.schedule);
        if (a.load_balance) given.push_back("--load-balance");
        hp::cp::check_nothing_given_without_cp("hp-cp-run", given,
                                               "the plain layer runs on the whole sequence");
      }
      hp_cp_run::MLAArgs mla;
      mla.attention = attention;
      if (attention == "dsa") mla.strategy = "all_gather";
      mla.topk = topk;
      mla.index_loss = index_loss;
      mla.input = a.input;
      mla.output = a.output;
      mla.cp_size = a.cp_size;
      if (app.count("--cp-algo") > 0) mla.strategy = a.algo;
      mla.schedule = a.schedule;
      mla.load_balance = a.load_balance;
      mla.primitive = a.primitive;
      mla.cu_seqlens = a.cu_seqlens;
      return hp_cp_run::run_mla(mla);
    }
    if (hp_cp_run::mixer_requested(app, m)) {
      if (a.cp_size == 1) {  // the plain mixer runs: no CP flag would do anything
        std::vector<std::string> given;
        if (app.count("--cp-mode") > 0) given.push_back("--cp-mode " + m.mode);
        if (app.count("--state-exchange") > 0) given.push_back("--state-exchange " + m.exchange);
        hp::cp::check_nothing_given_without_cp("hp-cp-run", given,
                                               "the plain mixer runs on the whole sequence");
      }
      m.cu_seqlens = a.cu_seqlens;
      m.input = a.input;
      m.output = a.output;
      m.cp_size = a.cp_size;
      return hp_cp_run::run_mixer(m);
    }
    return run(a);
  } catch (const std::exception& e) {
    // Messages that already name the tool are printed as they are.
    const std::string what = e.what();
    std::cerr << (what.rfind("hp-cp-run", 0) == 0 ? "" : "hp-cp-run: ") << what << std::endl;
    return 1;
  }
}
