// hyperparallel._C.plan: the planner's checks and summary for a Qwen3-family layout, before any
// process group exists (what `hp-train --validate`'s planning step runs; its messages are the
// planner's own).
#include <functional>
#include <utility>

#include <pybind11/stl.h>

#include "bindings.h"
#include "hp/common/check.h"
#include "hp/common/strings.h"
#include "hp/model/family.h"
#include "hp/plan/memory.h"
#include "hp/train/options.h"
#include "hp/train/preflight.h"

namespace py = pybind11;

namespace hp::python {
namespace {

using Setter = std::function<void(train::TrainOptions&, const py::handle&)>;

template <class T>
Setter field(T train::TrainOptions::*member) {
  return [member](train::TrainOptions& o, const py::handle& v) { o.*member = v.cast<T>(); };
}
template <class T>
Setter model_field(T model::Qwen3Config::*member) {
  return [member](train::TrainOptions& o, const py::handle& v) { o.model.*member = v.cast<T>(); };
}

// Keyword -> where it goes. CP keywords fill a ContextParallelConfig (below).
const std::map<std::string, Setter>& setters() {
  static const std::map<std::string, Setter> s = {
      {"tp", field(&train::TrainOptions::tp)},
      {"cp", field(&train::TrainOptions::cp)},
      {"dp_shard", field(&train::TrainOptions::dp_shard)},
      {"dp_replicate", field(&train::TrainOptions::dp_replicate)},
      {"ep", field(&train::TrainOptions::ep)},
      {"seq_len", field(&train::TrainOptions::seq_len)},
      {"batch", field(&train::TrainOptions::batch)},
      {"layers", model_field(&model::Qwen3Config::layers)},
      {"hidden", model_field(&model::Qwen3Config::hidden)},
      {"heads", model_field(&model::Qwen3Config::heads)},
      {"kv_heads", model_field(&model::Qwen3Config::kv_heads)},
      {"head_dim", model_field(&model::Qwen3Config::head_dim)},
      {"ffn", model_field(&model::Qwen3Config::ffn)},
      {"vocab", model_field(&model::Qwen3Config::vocab)},
      {"mixer", model_field(&model::Qwen3Config::mixer)},
      {"value_heads", model_field(&model::Qwen3Config::value_heads)},
      {"layer_pattern", model_field(&model::Qwen3Config::layer_pattern)},
      {"experts", model_field(&model::Qwen3Config::experts)},
      {"top_k", model_field(&model::Qwen3Config::moe_top_k)},
      {"linear_cp_mode",
       [](train::TrainOptions& o, const py::handle& v) { o.linear.mode = v.cast<std::string>(); }},
      {"state_exchange",
       [](train::TrainOptions& o, const py::handle& v) {
         o.linear.state_exchange = v.cast<std::string>();
       }},
      {"mla_cp",
       [](train::TrainOptions& o, const py::handle& v) { o.mla.strategy = v.cast<std::string>(); }},
  };
  return s;
}
const std::vector<std::string> kCPKeys = {"algorithm",        "ulysses_degree", "schedule",
                                          "load_balance",     "kv_head_policy", "head_groups",
                                          "ring_keep_blocks", "row_parts",      "ring_backward"};

std::string valid_keys() {
  std::string out = "arch";
  for (const auto& [k, _] : setters())
    out += ", " + k;
  for (const auto& k : kCPKeys)
    out += ", " + k;
  return out;
}

py::dict plan_layout(int64_t world_size, const py::dict& kwargs) {
  HP_CHECK(world_size >= 1, "plan: world_size ", world_size, " must be >= 1");
  train::TrainOptions o;
  std::string arch = "qwen3";
  cp::ContextParallelConfig c;
  std::string algorithm = "all_gather";
  bool cp_given = false;
  std::vector<std::string> cp_keys;  // CP keys given a value
  std::vector<std::string> tuned;    // CP keys algorithm='auto' would not run
  auto set = [&](const std::string& key, const py::handle& value) {
    if (key == "arch") {
      arch = value.cast<std::string>();
      return;
    }
    if (std::find(kCPKeys.begin(), kCPKeys.end(), key) != kCPKeys.end()) {
      cp_given = true;
      if (value.is_none()) return;
      cp_keys.push_back(key);
      if (key != "algorithm" && key != "load_balance" && key != "kv_head_policy")
        tuned.push_back(key);
      if (key == "algorithm") algorithm = value.cast<std::string>();
      if (key == "ulysses_degree") c.ulysses_degree = value.cast<int64_t>();
      if (key == "schedule") c.schedule = cp::parse_schedule(value.cast<std::string>());
      if (key == "load_balance") c.load_balance = value.cast<bool>();
      if (key == "kv_head_policy")
        c.kv_head_policy = cp::parse_kv_head_policy(value.cast<std::string>());
      if (key == "head_groups") c.ulysses_head_groups = value.cast<int64_t>();
      if (key == "ring_keep_blocks") c.ring_keep_blocks = value.cast<bool>();
      if (key == "row_parts") c.ulysses_row_parts = value.cast<int64_t>();
      if (key == "ring_backward")
        c.ring_backward = cp::parse_ring_backward(value.cast<std::string>());
      return;
    }
    auto it = setters().find(key);
    HP_CHECK(it != setters().end(), "plan: unknown option '", key, "'; valid: ", valid_keys());
    it->second(o, value);
  };
  for (const auto& [key_obj, value] : kwargs) {
    const auto key = key_obj.cast<std::string>();
    try {
      set(key, value);
    } catch (const py::cast_error&) {
      HP_CHECK(false, "plan: option '", key, "' has the wrong type (",
               std::string(py::str(py::type::of(value).attr("__name__"))), ")");
    }
  }
  HP_CHECK(algorithm != "auto" || tuned.empty(),
           "plan: algorithm='auto' chooses the strategy, its schedule, its Ulysses degree and "
           "ring_keep_blocks, with each strategy's defaults, so ",
           common::str_join(tuned), " would not run; drop ", tuned.size() == 1 ? "it" : "them",
           " or name the algorithm");
  model::apply_family(o.model, arch, {kwargs.contains("experts"), kwargs.contains("layers")});
  HP_CHECK(o.cp > 1 || cp_keys.empty(), "plan: ", common::str_join(cp_keys), " configure",
           cp_keys.size() == 1 ? "s" : "", " context parallelism, but cp is ", o.cp,
           " (no CP runs); drop ", cp_keys.size() == 1 ? "it" : "them", " or set cp > 1");
  for (const auto& [key, value] :
       {std::pair<const char*, int64_t>{"seq_len", o.seq_len}, {"batch", o.batch}}) {
    HP_CHECK(value >= 1, "plan: ", key, "=", value,
             " must be >= 1 (the memory estimate and the sequence checks size the run by it)");
  }
  o.cp_auto = algorithm == "auto";
  if (o.cp_auto) {
    HP_CHECK(o.cp > 1, "plan: algorithm='auto' needs cp > 1");
    algorithm = "all_gather";  // the planner replaces it
  }
  if (o.cp > 1 || cp_given) {
    c.algorithm = cp::parse_algorithm(algorithm);
    o.cp_config = c;
  }
  auto p = train::plan_layout(o, world_size);
  const auto memory = train::estimate_memory(o);
  py::dict out;
  out["summary"] = p.describe();
  py::dict mesh;
  for (const auto& d : p.mesh_dims)
    mesh[py::str(d.name)] = d.size;
  out["mesh"] = mesh;
  out["cp"] = p.cp_config ? py::cast(cp::describe(*p.cp_config, p.cp_size)) : py::none();
  py::dict modules;
  for (const auto& [path, spec] : p.modules) {
    const char* kind = spec.is_dsa         ? "dsa"
                       : spec.is_mla       ? "mla"
                       : spec.is_linear    ? "linear"
                       : spec.is_attention ? "attention"
                                           : "module";
    modules[py::str(path)] = kind;
  }
  out["modules"] = modules;
  out["ep"] = p.ep_size;
  out["has_moe"] = p.has_moe;
  out["memory_per_rank_bytes"] = memory.total();
  out["memory"] = memory.describe();
  out["log"] = p.log;
  return out;
}

}  // namespace

void bind_plan(py::module_& m) {
  m.def("plan", &plan_layout, py::arg("world_size"), py::arg("options"));
}

}  // namespace hp::python
