// hp-cp-run: one CP attention forward/backward over P ranks (threads in this process) on
// full-sequence tensors from a torch.save file; writes full-sequence results loadable by
// torch.load. For debugging and cross-checking against PyTorch.
//
//   hp-cp-run --input IN.pt --output OUT.pt --cp P --cp-algo all_gather|ulysses|hybrid
//     [--ulysses-degree U] [--schedule sync|async] [--load-balance] [--causal]
//     [--layout bnsd|bshd] [--primitive math|blockwise] [--adapter sdpa_qkv|...]
// IN.pt: dict with q, k, v, dout. OUT.pt: dict with out, dq, dk, dv (natural order).
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/bench/cp_layer.h"
#include "hp/comm/device_mesh.h"
#include "hp/comm/local_ranks.h"
#include "hp/common/check.h"
#include "hp/cp/adapter.h"
#include "hp/cp/sequence.h"
#include "hp/cp/strategy.h"
#include "hp/cp/volume.h"

namespace {

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  HP_CHECK(f.good(), "hp-cp-run: cannot open --input '", path, "'");
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

at::Tensor entry(const c10::IValue& dict, const std::string& key, const std::string& path) {
  HP_CHECK(dict.isGenericDict(), "hp-cp-run: '", path,
           "' does not hold a dict (save one with "
           "torch.save({'q': q, 'k': k, 'v': v, 'dout': dout}, path))");
  auto d = dict.toGenericDict();
  HP_CHECK(d.contains(key), "hp-cp-run: '", path, "' has no entry '", key,
           "'; it needs q, k, v and dout");
  auto t = d.at(key);
  HP_CHECK(t.isTensor(), "hp-cp-run: entry '", key, "' in '", path, "' is not a tensor");
  return t.toTensor().contiguous();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hp-cp-run: one CP attention forward/backward on tensors from a torch.save file"};
  std::string input, output, algo = "all_gather", schedule = "sync", layout = "bnsd";
  std::string primitive = "blockwise", adapter = "sdpa_qkv";
  int cp_size = 2;
  int64_t degree = 0;
  bool load_balance = false, causal = false;
  std::string lb_form = "runtime_swap";
  app.add_option("--input", input, "torch.save dict with q, k, v, dout")->required();
  app.add_option("--output", output, "where to write out, dq, dk, dv")->required();
  app.add_option("--cp", cp_size, "CP ranks (threads)")->check(CLI::Range(1, 64));
  app.add_option("--cp-algo", algo, hp::cp::StrategyRegistry::builtin().names_list(" | "));
  app.add_option("--ulysses-degree", degree, "Ulysses degree (hybrid)");
  app.add_option("--schedule", schedule, "sync | async");
  app.add_flag("--load-balance", load_balance, "head-tail load balance (all_gather)");
  app.add_option("--load-balance-form", lb_form,
                 "runtime_swap (contiguous shards, Q halves swapped) | data_order (shards "
                 "made by shard_sequence)");
  app.add_flag("--causal", causal, "causal attention");
  app.add_option("--layout", layout, "bnsd | bshd");
  app.add_option("--primitive", primitive, "math | blockwise");
  app.add_option("--adapter", adapter, hp::cp::AdapterRegistry::builtin().names_list(" | "));
  CLI11_PARSE(app, argc, argv);
  try {
    HP_CHECK(layout == "bnsd" || layout == "bshd", "hp-cp-run: --layout '", layout,
             "' is not valid; valid: bnsd, bshd");
    hp::cp::ContextParallelConfig c;
    c.algorithm = hp::cp::parse_algorithm(algo);
    c.schedule = hp::cp::parse_schedule(schedule);
    if (degree > 0) c.ulysses_degree = degree;
    c.load_balance = load_balance;
    HP_CHECK(lb_form == "runtime_swap" || lb_form == "data_order",
             "hp-cp-run: --load-balance-form '", lb_form,
             "' is not valid; valid: runtime_swap, data_order");
    c.load_balance_form = lb_form == "data_order" ? hp::cp::LoadBalanceForm::kDataOrder
                                                  : hp::cp::LoadBalanceForm::kRuntimeSwap;
    auto config = hp::cp::normalize(c, cp_size).value_or(hp::cp::ContextParallelConfig{});
    const bool bshd = layout == "bshd";
    auto in = torch::jit::pickle_load(read_bytes(input));
    auto q = entry(in, "q", input), k = entry(in, "k", input), v = entry(in, "v", input),
         dout = entry(in, "dout", input);
    const int64_t seq = bshd ? 1 : 2, head = bshd ? 2 : 1;
    HP_CHECK(q.dim() == 4, "hp-cp-run: q must be 4-d (", layout, "), got ", q.dim(), " dims");
    hp::cp::check_sequence(config, cp_size, q.size(seq));
    hp::cp::check_heads(config, cp_size, q.size(head), k.size(head));

    hp::bench::CPLayerOptions lo;
    lo.config = config;
    lo.adapter = adapter;
    lo.causal = causal;
    lo.bshd = bshd;
    lo.primitive = primitive;
    std::vector<hp::bench::CPLayerResult> results(cp_size);
    std::vector<int64_t> bytes(cp_size);
    std::string log;
    hp::comm::WorldOptions wo;
    wo.timeout = std::chrono::seconds(120);
    hp::comm::run_thread_ranks(
        cp_size,
        [&](hp::comm::World& w) {
          hp::comm::DeviceMesh mesh(w, {{"cp", cp_size}});
          const int r = w.rank();
          const bool data_order = config.load_balance &&
                                  config.load_balance_form == hp::cp::LoadBalanceForm::kDataOrder;
          auto part = [&](const at::Tensor& t) {
            return hp::cp::shard_sequence(t, seq, r, cp_size, data_order);
          };
          if (cp_size == 1) {
            // No CP: the plain primitive on the full tensors.
            hp::attention::CoreAttentionOptions co;
            co.attention.causal = causal;
            co.primitive = primitive;
            co.seq_dim = seq;
            co.heads_dim = head;
            hp::attention::CoreAttention core(co);
            auto q1 = q.detach().requires_grad_(true), k1 = k.detach().requires_grad_(true),
                 v1 = v.detach().requires_grad_(true);
            auto out = core.forward(q1, k1, v1);
            out.backward(dout);
            results[r] = {out.detach(), q1.grad(), k1.grad(), v1.grad()};
            return;
          }
          hp::bench::CPAttentionLayer layer(w, mesh.group_ptr({"cp"}), lo);
          w.context().counters.reset();
          results[r] = layer.run(part(q), part(k), part(v), part(dout));
          bytes[r] = w.context().counters.total_bytes();
          if (r == 0) log = layer.apply_log();
        },
        wo);
    const bool data_order =
        config.load_balance && config.load_balance_form == hp::cp::LoadBalanceForm::kDataOrder;
    auto cat = [&](at::Tensor hp::bench::CPLayerResult::*field) {
      std::vector<at::Tensor> parts;
      for (auto& res : results)
        parts.push_back(res.*field);
      return hp::cp::unshard_sequence(parts, seq, data_order);  // natural order
    };
    c10::Dict<std::string, at::Tensor> out;
    out.insert("out", cat(&hp::bench::CPLayerResult::out));
    out.insert("dq", cat(&hp::bench::CPLayerResult::dq));
    out.insert("dk", cat(&hp::bench::CPLayerResult::dk));
    out.insert("dv", cat(&hp::bench::CPLayerResult::dv));
    auto data = torch::jit::pickle_save(c10::IValue(out));
    {
      std::ofstream f(output + ".tmp", std::ios::binary);
      HP_CHECK(f.good(), "hp-cp-run: cannot write --output '", output, "'");
      f.write(data.data(), static_cast<std::streamsize>(data.size()));
    }
    HP_CHECK(std::rename((output + ".tmp").c_str(), output.c_str()) == 0,
             "hp-cp-run: cannot move the result to '", output, "'");
    hp::cp::AttentionShape shape{q.size(seq), q.size(head), k.size(head),
                                 q.size(3),   q.size(0),    static_cast<int64_t>(q.element_size())};
    std::vector<int64_t> theory_per_rank(cp_size, 0);
    for (int r = 0; cp_size > 1 && r < cp_size; ++r) {
      theory_per_rank[r] = 2 * hp::cp::forward_bytes_per_rank(config, cp_size, shape, r);
    }
    const int64_t theory = theory_per_rank[0];
    nlohmann::json j = {{"algorithm", hp::cp::to_string(config.algorithm)},
                        {"cp", cp_size},
                        {"ulysses_degree", hp::cp::ulysses_degree_of(config, cp_size)},
                        {"adapter", adapter},
                        {"load_balance", config.load_balance},
                        {"schedule", hp::cp::to_string(config.schedule)},
                        {"comm_bytes_per_rank", bytes},
                        {"comm_bytes_theory", theory},
                        {"comm_bytes_theory_per_rank", theory_per_rank}};
    if (!log.empty()) std::cerr << log << std::endl;
    std::cout << j.dump() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "hp-cp-run: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
