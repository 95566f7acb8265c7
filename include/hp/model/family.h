// The model families the source names, as settings of the one decoder (qwen3.h): a layer
// pattern, the linear-attention kind and the MLP. hp-train --arch picks one.
//
//   qwen3        softmax attention (or --mixer) in every layer, dense MLP
//   qwen3-moe    softmax attention, MoE MLP in every layer (8 experts, top-2 unless given)
//   qwen3.5      3 Gated DeltaNet layers to 1 gated softmax-attention layer ("LLLG") whose
//                RoPE covers a quarter of each head (partial_rotary_factor 0.25), dense MLP or
//                MoE (--experts)
//   kimi-linear  3 KDA layers to 1 MLA layer ("LLLM"), MoE MLP (8 experts unless given)
// A layer pattern set before (--layer-pattern) is kept. Without --layers a pattern longer than
// the model's layers sets their number (a pattern is never cut short: model::validate).
#pragma once

#include <string>
#include <vector>

#include "hp/model/qwen3.h"

namespace hp::model {

const std::vector<std::string>& family_names();
// Which of the family's defaults the caller set itself (on a command line, in a config file).
struct FamilyGiven {
  bool experts = false;  // an explicit experts = 0 is refused by the MoE families
  bool layers = false;   // else layers < the pattern's length becomes the pattern's length
};

// Sets the family's pattern, linear kind and MoE defaults; an unknown name lists the valid ones.
void apply_family(Qwen3Config& c, const std::string& arch, FamilyGiven given = {});

}  // namespace hp::model
