// Activation recompute (checkpointing) of a whole block: the forward keeps no activations of
// `fn`; the backward runs `fn` again with autograd on and back-propagates through it. Anything
// `fn` does in forward happens again in the recompute (collectives included: an async CP layer
// inside launches its own, new slots).
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hp::common {

using BlockFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Gradients reach `inputs` that require grad and every parameter `fn` uses.
std::vector<at::Tensor> checkpoint(const BlockFn& fn, const std::vector<at::Tensor>& inputs);

}  // namespace hp::common
