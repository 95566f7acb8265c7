// Hugging Face checkpoints of the qwen3 and qwen3-moe families: a directory with config.json and
// model.safetensors, or shards listed by model.safetensors.index.json (DESIGN section 14,
// model/hf/). Parameter names are those of the Hugging Face implementations
// (model.layers.<i>.self_attn.q_proj.weight, model.layers.<i>.mlp.experts.<j>.up_proj.weight,
// lm_head.weight, ...); bf16 / fp16 / fp32 files convert to the model's dtype on load.
//
// Reading never loads a whole file: tensors are views of memory-mapped files, and each rank
// copies only the slice it holds (HFSlice: its TP slice, its EP experts, its HSDP rows).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/model/qwen3.h"
#include "hp/model/safetensors.h"

namespace hp::model {

// The model config.json describes, and its family (qwen3 | qwen3-moe). Anything this decoder
// cannot represent (attention bias, sliding windows, dense layers between MoE layers, a
// model_type other than qwen3 / qwen3_moe) is refused naming the key.
struct HFModel {
  Qwen3Config config;
  std::string arch;
};
HFModel read_hf_config(const std::string& dir);
// config.json for `c` (qwen3, or qwen3_moe when c.experts > 0).
void write_hf_config(const Qwen3Config& c, const std::string& dir);
// Refuses configs the Hugging Face format here does not cover (other mixers, gated or mixed
// layers, a shared expert), naming what to change.
void check_hf_compatible(const Qwen3Config& c);

// The checkpoint's tensors by Hugging Face name, across its files.
class HFDirectory {
 public:
  explicit HFDirectory(const std::string& dir);
  at::Tensor view(const std::string& hf_name) const;  // read-only, zero-copy
  bool has(const std::string& hf_name) const;
  std::vector<std::string> names() const;  // every tensor of the checkpoint, sorted
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// The Hugging Face tensors one of this model's parameters is made of: one name, or for the
// stacked experts of an MoE layer (layers.<i>.mlp.gate_proj|up_proj|down_proj) one per expert,
// expert 0 first.
std::vector<std::string> hf_names(const std::string& param, const Qwen3Config& c);
bool is_stacked_experts(const std::string& param);

// Refuses a checkpoint holding tensors that none of `params` (this model's parameter names)
// reads, naming the first few: a config.json that describes fewer layers or experts than the
// weights, or another architecture's weights. lm_head.weight beside tied embeddings is a copy
// and is let through.
void check_no_unread_tensors(const HFDirectory& dir, const Qwen3Config& c,
                             const std::vector<std::string>& params);

// What one rank holds of a parameter: the slice along tp_dim for tp_rank of tp_size (tp_dim < 0:
// not split by TP), for stacked experts the experts from expert_begin on, and of that tensor the
// rows [row_begin, row_begin + rows) of dim 0 (rows < 0: every row; an HSDP shard).
struct HFSlice {
  int64_t tp_dim = -1, tp_rank = 0, tp_size = 1;
  int64_t expert_begin = 0;
  int64_t row_begin = 0, rows = -1;
  // The model's whole parameter, before TP and HSDP take their slices (stacked experts: one
  // expert's shape is full_shape[1:]). Empty: only the slice is checked, and a checkpoint
  // tensor larger than the model could pass where the slice fits.
  std::vector<int64_t> full_shape;
};
// Copies that slice of `param` from the checkpoint into `dest` (rows of dest past the slice,
// HSDP padding, are zeroed). Shapes are checked against the checkpoint, naming the tensor: the
// whole tensor against slice.full_shape first (and a TP dim divisible by tp_size), then the slice.
void load_hf_parameter(const HFDirectory& dir, const Qwen3Config& c, const std::string& param,
                       const HFSlice& slice, at::Tensor dest);

}  // namespace hp::model
