#include <algorithm>
#include <filesystem>
#include <fstream>
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

}  // namespace

HFModel read_hf_config(const std::string& dir) {
  const auto path = (fs::path(dir) / "config.json").string();
  const auto j = read_json(path);
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
  HFModel m;
  m.arch = type == "qwen3" ? "qwen3" : "qwen3-moe";
  auto& c = m.config;
  c.vocab = j.at("vocab_size");
  c.hidden = j.at("hidden_size");
  c.layers = j.at("num_hidden_layers");
  c.heads = j.at("num_attention_heads");
  c.kv_heads = j.value("num_key_value_heads", c.heads);
  c.head_dim = j.value("head_dim", c.hidden / c.heads);
  c.ffn = j.at("intermediate_size");
  c.rms_eps = j.value("rms_norm_eps", 1e-6);
  c.rope_theta = j.value("rope_theta", 1e6);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  if (type == "qwen3_moe") {
    refuse_if(j.value("decoder_sparse_step", 1) != 1, "decoder_sparse_step",
              "must be 1 (every layer an MoE layer)");
    refuse_if(!j.value("mlp_only_layers", nlohmann::json::array()).empty(), "mlp_only_layers",
              "must be empty (every layer an MoE layer)");
    c.experts = j.at("num_experts");
    c.moe_top_k = j.at("num_experts_per_tok");
    c.moe_ffn = j.at("moe_intermediate_size");
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
  if (is_stacked_experts(param)) {
    std::vector<at::Tensor> experts;
    for (int64_t i = 0; i < local_rows; ++i) {
      const int64_t e = s.expert_begin + s.row_begin + i;
      HP_CHECK(e < static_cast<int64_t>(names.size()), "hf: ", param, ": expert ", e,
               " is past the ", names.size(), " experts of the checkpoint");
      experts.push_back(dir.view(names[static_cast<size_t>(e)]));
    }
    src = experts.empty() ? dest.narrow(0, 0, 0) : at::stack(experts);
  } else {
    src = dir.view(names.front());
    if (s.tp_dim >= 0 && s.tp_size > 1) {
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
