// hyperparallel._C.CPAttention and linear_attention_cp: the library's CP attention and linear
// mixers on torch tensors, over a TorchGroup. Autograd crosses unchanged: the output's graph is
// the library's (its backward runs the collectives), so gradients flow to the caller's q, k, v.
//
// CPAttention is the *_qkv module boundary with handoff points on q, k and v (what the async
// schedule starts its collectives at), installed once per configuration by the same
// apply_context_parallel a model gets; auto_config asks the cost model for the configuration.
#include <algorithm>

#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "hp/attention/attention.h"
#include "hp/attention/core_attention.h"
#include "hp/attention/delta_rule.h"
#include "hp/attention/handoff.h"
#include "hp/attention/linear_host.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/common/shape.h"
#include "hp/cp/apply.h"
#include "hp/cp/linear_mixer.h"
#include "hp/plan/cost_model.h"

namespace py = pybind11;

namespace hp::python {
namespace {

struct CPAttentionArgs {
  std::string algorithm = "ulysses";
  std::optional<int64_t> ulysses_degree;
  bool causal = false;
  std::string layout = "bshd";
  bool load_balance = false;
  std::string schedule = "sync";
  std::optional<double> scale;
  std::string kv_head_policy = "error";
  int64_t head_groups = 0;
  std::string primitive = "blockwise";
  bool ring_keep_blocks = false;
  int64_t row_parts = 0;
  std::string ring_backward = "auto";
};

bool is_bshd(const std::string& layout) {
  HP_CHECK(layout == "bshd" || layout == "bnsd", "layout='", layout,
           "' is not valid; valid: bshd ([batch, seq, heads, dim]), bnsd ([batch, heads, seq, "
           "dim])");
  return layout == "bshd";
}

class CPAttention {
 public:
  CPAttention(std::shared_ptr<TorchGroup> group, const CPAttentionArgs& a)
      : group_(std::move(group)), bshd_(is_bshd(a.layout)), core_(core_options(a)) {
    for (auto* h : {&q_handoff_, &k_handoff_, &v_handoff_})
      core_.host().add_handoff(h);
    cp::ContextParallelConfig c;
    c.algorithm = cp::parse_algorithm(a.algorithm);
    c.schedule = cp::parse_schedule(a.schedule);
    c.ulysses_degree = a.ulysses_degree;
    c.load_balance = a.load_balance;
    c.kv_head_policy = cp::parse_kv_head_policy(a.kv_head_policy);
    c.ulysses_head_groups = a.head_groups;
    c.ring_keep_blocks = a.ring_keep_blocks;
    c.ulysses_row_parts = a.row_parts;
    c.ring_backward = cp::parse_ring_backward(a.ring_backward);
    const int64_t p = group_->group()->size();
    auto config = cp::normalize(c, p);
    if (!config) return;  // one rank: the plain primitive
    config_ = *config;
    cp::CPModuleSpec spec;
    spec.module_path = "context_parallel_attention";
    spec.inner_wrapper = "sdpa_qkv";
    spec.cp_handoff_targets = {{"q", "q_handoff"}, {"k", "k_handoff"}, {"v", "v_handoff"}};
    if (bshd_) {
      spec.cp_seq_dim = 1;
      spec.cp_head_dim = 2;
    }
    cp::CPApplyOptions ao;
    ao.log = [this](const std::string& line) { log_ = line; };
    cp::apply_context_parallel(core_.host(), spec, *config, group_->topology(*config), ao);
  }

  // `docs`: this call's packed documents (ids of the whole sequence), or undefined.
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& docs) {
    check_tensor("q", q);
    check_tensor("k", k);
    check_tensor("v", v);
    HP_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
             "q, k and v must share one dtype; got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
             v.scalar_type());
    HP_CHECK(q.device() == k.device() && q.device() == v.device(),
             "q, k and v must be on one device; got ", q.device(), ", ", k.device(), ", ",
             v.device());
    const int64_t heads = bshd_ ? 2 : 1;
    if (config_) {
      cp::check_heads(*config_, group_->group()->size(), q.size(heads), k.size(heads));
    }
    auto options = core_.options().attention;
    if (docs.defined()) options.documents = attention::Documents{docs};
    // The scope opens before the handoffs: its begin drops what a forward that failed between
    // its handoffs and its attention left; its end reports a forward that never reached it.
    auto scope = core_.host().forward_scope();
    core_.host().announce(options);  // async CP may skip moves the documents hide
    auto out = core_.forward(q_handoff_(q), k_handoff_(k), v_handoff_(v), options);
    scope.end();
    return out;
  }

  const std::string& log() const { return log_; }
  std::string describe() const {
    return config_ ? cp::describe(*config_, group_->group()->size()) : "no CP (one rank)";
  }

 private:
  void check_tensor(const char* name, const at::Tensor& t) const {
    HP_CHECK(t.defined(), name, " is not a tensor");
    HP_CHECK(t.dim() == 4, name, " must be 4-d (",
             bshd_ ? "bshd: [batch, seq, heads, dim]" : "bnsd: [batch, heads, seq, dim]", "), got ",
             t.dim(), " dims ", common::shape_str(t.sizes()));
    HP_CHECK(at::isFloatingType(t.scalar_type()), name, " has dtype ", t.scalar_type(),
             "; attention needs a floating dtype (float32, float64, bfloat16)");
    const auto backend = group_->group()->transport().backend_name();
    HP_CHECK(backend != "gloo" || t.device().is_cpu(), name, " is on ", t.device(),
             " but the group's backend is gloo (CPU tensors); move it to the CPU or use an nccl "
             "group");
  }

  static attention::CoreAttentionOptions core_options(const CPAttentionArgs& a) {
    attention::CoreAttentionOptions c;
    c.attention.causal = a.causal;
    c.attention.scale = a.scale;
    c.primitive = a.primitive;
    if (is_bshd(a.layout)) {
      c.seq_dim = 1;
      c.heads_dim = 2;
    }
    return c;
  }

  std::shared_ptr<TorchGroup> group_;
  bool bshd_;
  attention::CoreAttention core_;
  attention::HandoffPoint q_handoff_{"q_handoff"}, k_handoff_{"k_handoff"}, v_handoff_{"v_handoff"};
  std::optional<cp::ContextParallelConfig> config_;
  std::string log_;
};

// algorithm='auto': the cost model's fastest legal configuration for this call's sizes on this
// machine's calibration. Every rank ranks the candidates; rank 0's choice is taken by all (one
// all-gather of an index), so ranks with different calibrations still agree.
// kv_head_policy 'repeat' lets the Ulysses candidates repeat K/V heads fewer than their degree.
// algorithm, Ulysses degree, schedule, ring_keep_blocks, the cost model's description, and the
// K/V head policy that runs ('error' where the choice repeats nothing).
using AutoChoice = std::tuple<std::string, int64_t, std::string, bool, std::string, std::string>;
AutoChoice auto_config(TorchGroup& g, int64_t seq, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t batch, bool causal, bool load_balance,
                       const std::string& primitive, const std::string& kv_head_policy) {
  const int64_t p = g.group()->size();
  plan::CPWorkload w;
  w.seq = seq;
  w.heads = heads;
  w.kv_heads = kv_heads;
  w.head_dim = head_dim;
  w.batch = batch;
  w.causal = causal;
  w.projections = false;
  w.load_balance = load_balance;
  w.kv_head_policy = cp::parse_kv_head_policy(kv_head_policy);
  w.ring_recomputes =
      !attention::AttentionRegistry::builtin().get(primitive).offers_backward_from_stats();
  const auto legal = plan::legal_cp_configs(p, w);
  HP_CHECK(!legal.empty(), "algorithm='auto': no CP configuration is legal for ", heads,
           " query heads and ", kv_heads, " K/V heads on ", p, " ranks");
  // Each rank ranks with its own calibration; rank 0's choice is taken. A rank that cannot rank
  // (an unreadable calibration) says so in the gather instead of leaving the others waiting.
  int64_t mine = -1;
  std::string why, top_text;
  try {
    const auto calibration =
        plan::load_calibration(plan::default_calibration_path(plan::current_link()));
    const auto top = plan::rank_cp_configs(calibration, p, w).front();
    top_text = plan::describe(top);
    for (size_t i = 0; i < legal.size(); ++i) {
      const auto& c = legal[i];
      const auto& best = top.config;
      if (c.algorithm == best.algorithm && c.schedule == best.schedule &&
          c.ring_keep_blocks == best.ring_keep_blocks &&
          cp::ulysses_degree_of(c, p) == cp::ulysses_degree_of(best, p))
        mine = static_cast<int64_t>(i);
    }
    if (mine < 0) why = "its best configuration (" + top_text + ") is not among the legal ones";
  } catch (const std::exception& e) {
    why = e.what();
  }
  auto all = comm::all_gather(*g.group(), at::full({1}, mine, at::kLong), 0);
  HP_CHECK(why.empty(), "algorithm='auto': this rank could not choose a CP configuration: ", why);
  for (int64_t r = 0; r < p; ++r) {
    HP_CHECK(all[r].item<int64_t>() >= 0, "algorithm='auto': rank ", r,
             " could not choose a CP configuration (see its error: its calibration, "
             "HP_CALIBRATION or HP_LINK_RATE); name the algorithm, or fix that rank's calibration");
  }
  const auto& chosen = legal.at(all[0].item<int64_t>());
  return {cp::to_string(chosen.algorithm),
          cp::ulysses_degree_of(chosen, p),
          cp::to_string(chosen.schedule),
          chosen.ring_keep_blocks,
          top_text,
          cp::to_string(chosen.kv_head_policy)};
}

py::tuple linear_attention(TorchGroup& g, const std::string& kind, const std::string& mode,
                           const std::string& state_exchange, const std::string& kernel,
                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& gate, const at::Tensor& beta,
                           const std::optional<at::Tensor>& initial_state, bool output_final_state,
                           std::optional<double> scale, int64_t chunk_size,
                           const std::optional<at::Tensor>& doc_ids) {
  HP_CHECK(kind == "gdn" || kind == "kda", "kind='", kind,
           "' is not valid; valid: gdn (Gated DeltaNet, g [B, T, HV]), kda (Kimi Delta "
           "Attention, g [B, T, HV, K])");
  attention::MixerInputs in{q, k, v, gate, beta, initial_state.value_or(at::Tensor()), {}};
  if (doc_ids) {  // this rank's contiguous shard of the whole sequence's document starts
    const int64_t t = q.size(1);
    in.resets = attention::linear_documents(*doc_ids, g.group()->rank() * t, t, 1)
                    .resets.expand({q.size(0), t})
                    .contiguous();
  }
  attention::MixerOptions options;
  options.scale = scale;
  options.output_final_state = output_final_state;
  options.chunk_size = chunk_size;
  cp::LinearMixerCPOptions cpo;
  cpo.mode = mode;
  cpo.state_exchange = state_exchange;
  cpo.kernel = kernel;
  cp::ContextParallelConfig c;  // the linear modes use the CP group itself
  auto topology = g.topology(cp::normalize(c, g.group()->size()).value_or(c));
  attention::MixerResult r;
  {
    py::gil_scoped_release no_gil;
    r = cp::linear_mixer_cp(
        in, options,
        kind == "gdn" ? attention::GateKind::kPerHead : attention::GateKind::kPerChannel, cpo,
        *topology);
  }
  return py::make_tuple(r.out, r.final_state.defined() ? py::cast(r.final_state) : py::none());
}

}  // namespace

void bind_attention(py::module_& m) {
  py::class_<CPAttention, std::shared_ptr<CPAttention>>(m, "CPAttention")
      .def(py::init([](std::shared_ptr<TorchGroup> group, const std::string& algorithm,
                       std::optional<int64_t> ulysses_degree, bool causal,
                       const std::string& layout, bool load_balance, const std::string& schedule,
                       std::optional<double> scale, const std::string& kv_head_policy,
                       int64_t head_groups, const std::string& primitive, bool ring_keep_blocks,
                       int64_t row_parts, const std::string& ring_backward) {
             CPAttentionArgs a{
                 algorithm,        ulysses_degree, causal,         layout,      load_balance,
                 schedule,         scale,          kv_head_policy, head_groups, primitive,
                 ring_keep_blocks, row_parts,      ring_backward};
             return std::make_shared<CPAttention>(std::move(group), a);
           }),
           py::arg("group"), py::arg("algorithm"), py::arg("ulysses_degree"), py::arg("causal"),
           py::arg("layout"), py::arg("load_balance"), py::arg("schedule"), py::arg("scale"),
           py::arg("kv_head_policy"), py::arg("head_groups"), py::arg("primitive"),
           py::arg("ring_keep_blocks") = false, py::arg("row_parts") = 0,
           py::arg("ring_backward") = "auto")
      .def(
          "__call__",
          [](CPAttention& self, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const std::optional<at::Tensor>& doc_ids) {
            return self.forward(q, k, v, doc_ids.value_or(at::Tensor()));
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("doc_ids") = py::none(),
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("log", &CPAttention::log)
      .def("describe", &CPAttention::describe);
  m.def("auto_config", &auto_config, py::arg("group"), py::arg("seq"), py::arg("heads"),
        py::arg("kv_heads"), py::arg("head_dim"), py::arg("batch"), py::arg("causal"),
        py::arg("load_balance"), py::arg("primitive") = "blockwise",
        py::arg("kv_head_policy") = "error", py::call_guard<py::gil_scoped_release>());
  m.def("linear_attention_cp", &linear_attention, py::arg("group"), py::arg("kind"),
        py::arg("mode"), py::arg("state_exchange"), py::arg("kernel"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("initial_state"),
        py::arg("output_final_state"), py::arg("scale"), py::arg("chunk_size"),
        py::arg("doc_ids") = py::none());
  m.def("document_ids", &attention::document_ids_from_cu_seqlens, py::arg("cu_seqlens"),
        py::arg("total"));
}

}  // namespace hp::python
