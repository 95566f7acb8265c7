#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "hp/common/check.h"
#include "hp/common/strings.h"
#include "hp/model/hf.h"

namespace hp::model {
namespace fs = std::filesystem;

namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  HP_CHECK(f.good(), "hf: cannot open '", path, "'");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    HP_CHECK(false, "hf: '", path, "' is not valid JSON: ", e.what());
  }
}

const std::regex& stacked_pattern() {
  static const std::regex re(R"(layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj))");
  return re;
}

HFModel read_hf_config_json(const nlohmann::json& j, const std::string& path) {
  const std::string type = j.value("model_type", "");
  HP_CHECK(type == "qwen3" || type == "qwen3_moe", "hf: '", path, "' has model_type '", type,
           "'; supported: qwen3, qwen3_moe");
  auto refuse_if = [&](bool bad, const std::string& key, const std::string& why) {
    HP_CHECK(!bad, "hf: '", path, "': ", key, " ", why);
  };
  refuse_if(j.value("attention_bias", false), "attention_bias=true",
            "is not supported (the projections have no bias)");
  refuse_if(j.value("use_sliding_window", false), "use_sliding_window=true",
            "is not supported (attention is causal over the whole sequence)");
  refuse_if(j.contains("rope_scaling") && !j.at("rope_scaling").is_null(), "rope_scaling",
            "is not supported (RoPE here is unscaled: rope_theta alone); set it to null or use a "
            "checkpoint without it");
  const std::string act = j.value("hidden_act", "silu");
  refuse_if(act != "silu", "hidden_act='" + act + "'",
            "is not supported (the MLP and experts are SwiGLU: silu)");
  // A size: an integer (a float or a string is refused, not truncated), or `fallback` where the
  // key is absent (none: required).
  auto size = [&](const char* key, std::optional<int64_t> fallback) -> int64_t {
    if (!j.contains(key) || j.at(key).is_null()) {
      HP_CHECK(fallback.has_value(), "hf: '", path, "' has no ", key,
               "; a Qwen3 config.json gives it");
      return *fallback;
    }
    HP_CHECK(j.at(key).is_number_integer(), "hf: '", path, "': ", key, " is ", j.at(key).dump(),
             "; it must be an integer");
    return j.at(key).get<int64_t>();
  };
  // Newer transformers keep RoPE's settings in rope_parameters: theta there, and only the
  // default (unscaled) type.
  const auto rope = j.contains("rope_parameters") && j.at("rope_parameters").is_object()
                        ? j.at("rope_parameters")
                        : nlohmann::json::object();
  refuse_if(rope.value("rope_type", std::string("default")) != "default",
            "rope_parameters.rope_type",
            "is not supported (RoPE here is unscaled: rope_theta alone; rope_type default)");
  HFModel m;
  m.arch = type == "qwen3" ? "qwen3" : "qwen3-moe";
  auto& c = m.config;
  c.vocab = size("vocab_size", std::nullopt);
  c.hidden = size("hidden_size", std::nullopt);
  c.layers = size("num_hidden_layers", std::nullopt);
  c.heads = size("num_attention_heads", std::nullopt);
  HP_CHECK(c.heads > 0, "hf: '", path, "': num_attention_heads is ", c.heads,
           "; it must be positive");
  c.kv_heads = size("num_key_value_heads", c.heads);
  c.head_dim = size("head_dim", c.hidden / c.heads);
  c.ffn = size("intermediate_size", std::nullopt);
  c.rms_eps = j.value("rms_norm_eps", 1e-6);
  c.rope_theta =
      j.contains("rope_theta") ? j.at("rope_theta").get<double>() : rope.value("rope_theta", 1e6);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  if (type == "qwen3_moe") {
    refuse_if(j.value("decoder_sparse_step", 1) != 1, "decoder_sparse_step",
              "must be 1 (every layer an MoE layer)");
    refuse_if(!j.value("mlp_only_layers", nlohmann::json::array()).empty(), "mlp_only_layers",
              "must be empty (every layer an MoE layer)");
    c.experts = size("num_experts", std::nullopt);
    c.moe_top_k = size("num_experts_per_tok", std::nullopt);
    c.moe_ffn = size("moe_intermediate_size", std::nullopt);
    c.moe_renormalize = j.value("norm_topk_prob", false);
    // Hugging Face's load-balancing loss is one value over every layer's tokens together, k
    // when balanced; this decoder's sums a per-layer loss of 1 when balanced (moe/router.h). The
    // same pull on each layer's router: coefficient x k / layers.
    c.aux_loss_coef = j.value("router_aux_loss_coef", 0.001) * static_cast<double>(c.moe_top_k) /
                      static_cast<double>(c.layers);
  }
  validate(c);
  return m;
}

}  // namespace

HFModel read_hf_config(const std::string& dir) {
  const auto path = (fs::path(dir) / "config.json").string();
  try {
    return read_hf_config_json(read_json(path), path);
  } catch (const nlohmann::json::exception& e) {  // a value of the wrong type
    HP_CHECK(false, "hf: '", path, "' does not read as a Qwen3 config: ", e.what());
  }
}

void check_hf_compatible(const Qwen3Config& c) {
  HP_CHECK(c.layer_pattern.empty() && c.mixer == "attention",
           "hf: Hugging Face checkpoints are supported for the qwen3 and qwen3-moe families "
           "(softmax attention in every layer); this model's layers are ",
           c.layer_pattern.empty() ? c.mixer : "the pattern " + c.layer_pattern);
  HP_CHECK(c.partial_rotary_factor == 1.0,
           "hf: Qwen3 and Qwen3-MoE rotate every channel of a head; ",
           "this model's partial_rotary_factor is ", c.partial_rotary_factor,
           "; drop --partial-rotary-factor to read or write Hugging Face checkpoints");
  HP_CHECK(c.shared_expert_ffn == 0,
           "hf: Qwen3-MoE has no shared expert; drop --shared-expert-ffn to read or write "
           "Hugging Face checkpoints");
}

void write_hf_config(const Qwen3Config& c, const std::string& dir) {
  check_hf_compatible(c);
  nlohmann::json j = {
      {"model_type", c.experts > 0 ? "qwen3_moe" : "qwen3"},
      {"architectures", {c.experts > 0 ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"}},
      {"vocab_size", c.vocab},
      {"hidden_size", c.hidden},
      {"num_hidden_layers", c.layers},
      {"num_attention_heads", c.heads},
      {"num_key_value_heads", c.kv_heads},
      {"head_dim", c.head_dim},
      {"intermediate_size", c.ffn},
      {"rms_norm_eps", c.rms_eps},
      {"rope_theta", c.rope_theta},
      {"tie_word_embeddings", c.tie_embeddings},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"torch_dtype", "float32"}};
  if (c.experts > 0) {
    j["num_experts"] = c.experts;
    j["num_experts_per_tok"] = c.moe_top_k;
    j["moe_intermediate_size"] = moe_config(c).expert_ffn;
    j["norm_topk_prob"] = c.moe_renormalize;
    j["router_aux_loss_coef"] =  // read_hf_config's conversion, inverted
        c.aux_loss_coef * static_cast<double>(c.layers) / static_cast<double>(c.moe_top_k);
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = nlohmann::json::array();
  }
  fs::create_directories(dir);
  const auto path = (fs::path(dir) / "config.json").string();
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  f.close();
  HP_CHECK(!f.fail(), "hf: writing '", path, "' failed");
}

HFDirectory::HFDirectory(const std::string& dir) : dir_(dir) {
  const auto index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(index)) {
    const auto j = read_json(index.string());
    std::map<std::string, std::string> map = j.at("weight_map");
    for (const auto& [name, file] : map) {
      if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
    }
  } else {
    HP_CHECK(fs::exists(fs::path(dir) / "model.safetensors"), "hf: '", dir,
             "' has neither model.safetensors nor model.safetensors.index.json");
    files.push_back("model.safetensors");
  }
  for (const auto& f : files) {
    files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / f).string()));
    for (const auto& n : files_.back()->names())
      where_[n] = files_.back().get();
  }
}

bool HFDirectory::has(const std::string& name) const {
  return where_.count(name) > 0;
}

std::vector<std::string> HFDirectory::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_)
    out.push_back(name);
  return out;
}

void check_no_unread_tensors(const HFDirectory& dir, const Qwen3Config& c,
                             const std::vector<std::string>& params) {
  std::set<std::string> read;
  for (const auto& p : params)
    for (auto& n : hf_names(p, c))
      read.insert(std::move(n));
  std::vector<std::string> unread;
  for (const auto& n : dir.names())
    if (read.count(n) == 0 && !(c.tie_embeddings && n == "lm_head.weight")) unread.push_back(n);
  if (unread.empty()) return;
  const std::vector<std::string> shown(unread.begin(),
                                       unread.begin() + std::min<std::ptrdiff_t>(unread.size(), 4));
  HP_CHECK(false, "hf: '", dir.dir(), "' holds ", unread.size(),
           " tensor(s) this model does not read (", common::str_join(shown),
           unread.size() > shown.size() ? ", ..." : "",
           "); its config.json does not describe its weights (layers, experts, architecture)");
}

at::Tensor HFDirectory::view(const std::string& name) const {
  auto it = where_.find(name);
  HP_CHECK(it != where_.end(), "hf: '", dir_, "' has no tensor '", name,
           "'; is it a checkpoint of this model (its config.json)?");
  return it->second->view(name);
}

bool is_stacked_experts(const std::string& param) {
  return std::regex_match(param, stacked_pattern());
}

std::vector<std::string> hf_names(const std::string& param, const Qwen3Config& c) {
  if (param == "embed_tokens") return {"model.embed_tokens.weight"};
  if (param == "lm_head") return {"lm_head.weight"};
  if (param == "norm.weight") return {"model.norm.weight"};
  std::smatch m;
  if (std::regex_match(param, m, stacked_pattern())) {
    std::vector<std::string> out;
    for (int64_t e = 0; e < c.experts; ++e) {
      out.push_back(common::str_cat("model.layers.", m[1].str(), ".mlp.experts.", e, ".",
                                    m[2].str(), ".weight"));
    }
    return out;
  }
  static const std::regex router(R"(layers\.(\d+)\.mlp\.router)");
  if (std::regex_match(param, m, router)) {
    return {"model.layers." + m[1].str() + ".mlp.gate.weight"};
  }
  HP_CHECK(param.rfind("layers.", 0) == 0, "hf: parameter '", param, "' has no Hugging Face name");
  return {"model." + param};
}

void load_hf_parameter(const HFDirectory& dir, const Qwen3Config& c, const std::string& param,
                       const HFSlice& s, at::Tensor dest) {
  const auto names = hf_names(param, c);
  at::Tensor src;
  const int64_t local_rows = s.rows >= 0 ? s.rows : dest.size(0);
  // The whole checkpoint tensor: floating point, and the model's whole parameter's shape, before
  // any slice hides a difference (a slice of a larger tensor has the slice's shape).
  const auto check_whole = [&](const at::Tensor& t, const std::string& name,
                               at::IntArrayRef expected) {
    HP_CHECK(at::isFloatingType(t.scalar_type()), "hf: '", name, "' in '", dir.dir(), "' is ",
             c10::toString(t.scalar_type()), "; the model's weights are floating point (a ",
             "quantized or integer checkpoint is not read here)");
    HP_CHECK(expected.empty() || t.sizes() == expected, "hf: '", name, "' in '", dir.dir(), "' is ",
             t.sizes(), " but the model's parameter '", param, "' is ", expected,
             " (before sharding); the checkpoint does not match the model (config.json)");
  };
  const at::IntArrayRef full(s.full_shape);
  if (is_stacked_experts(param)) {
    std::vector<at::Tensor> experts;
    for (int64_t i = 0; i < local_rows; ++i) {
      const int64_t e = s.expert_begin + s.row_begin + i;
      HP_CHECK(e < static_cast<int64_t>(names.size()), "hf: ", param, ": expert ", e,
               " is past the ", names.size(), " experts of the checkpoint");
      const auto& name = names[static_cast<size_t>(e)];
      experts.push_back(dir.view(name));
      check_whole(experts.back(), name, full.empty() ? full : full.slice(1));
    }
    src = experts.empty() ? dest.narrow(0, 0, 0) : at::stack(experts);
  } else {
    src = dir.view(names.front());
    check_whole(src, names.front(), full);
    if (s.tp_dim >= 0 && s.tp_size > 1) {
      HP_CHECK(src.size(s.tp_dim) % s.tp_size == 0, "hf: '", names.front(), "' in '", dir.dir(),
               "' has ", src.size(s.tp_dim), " entries in dim ", s.tp_dim,
               ", which tensor parallelism splits over tp_size=", s.tp_size,
               "; choose a tp_size that divides it");
      const int64_t n = src.size(s.tp_dim) / s.tp_size;
      src = src.narrow(s.tp_dim, s.tp_rank * n, n);
    }
    if (s.rows >= 0) src = src.narrow(0, s.row_begin, s.rows);
  }
  auto target = dest.narrow(0, 0, local_rows);
  HP_CHECK(src.sizes() == target.sizes(), "hf: '", names.front(), "' in '", dir.dir(), "' gives ",
           src.sizes(), " for parameter '", param, "', which holds ", target.sizes(),
           " here; the checkpoint does not match the model (config.json)");
  at::NoGradGuard guard;
  target.copy_(src);
  if (local_rows < dest.size(0)) dest.narrow(0, local_rows, dest.size(0) - local_rows).zero_();
}

}  // namespace hp::model
