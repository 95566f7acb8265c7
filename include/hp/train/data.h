// The trainer's data (DESIGN section 10): the embedded copy task, or token ids read from a file.
// Batches are a pure function of (seed, step, micro-batch), so a resumed run sees the same data.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "hp/train/options.h"

namespace hp::train {

// One global batch of `options.batch` rows: `ids` and `labels`, both [batch, seq_len] int64.
// Without --data, the embedded long-range task: a random block of tokens, then the same block
// again; the loss counts only the second half, so it can fall only if attention reaches S/2
// tokens back (across CP shards). With --data, random windows of the file's tokens and their
// next tokens. Deterministic in (seed, step, micro); `micro` > 0 selects another micro-batch of
// the same step.
void make_batch(const TrainOptions& options, int64_t step, at::Tensor& ids, at::Tensor& labels,
                int64_t micro = 0);

}  // namespace hp::train
