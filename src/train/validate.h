// Internal to train/: --validate, the same model, init and data trained single-process on the
// full sequence and compared with the distributed run (same kernels; only the layout differs).
#pragma once

#include <vector>

#include "hp/comm/world.h"
#include "hp/train/trainer.h"
#include "runner.h"

namespace hp::train {

struct Validation {
  double max_abs_loss_diff = 0;  // over every step the run did not skip
  double max_rel_grad_diff = 0;  // full gradients of the first step not skipped (grad_step)
  int64_t grad_step = 0;         // that step (1 unless --nan-policy skip-step skipped step 1)
};

// Collective over `world`: rank 0 trains the reference on `corpus` for every step of `steps`
// (the distributed run's metrics from step 1), compares the losses and `run.first_grads` with
// it, and prints the result; the other ranks wait and return zeros. A step the run skipped
// (non-finite, --nan-policy skip-step) is skipped by the reference too and not compared.
Validation validate_against_reference(const comm::World& world, const Runner& run,
                                      const Corpus& corpus, const std::vector<StepMetrics>& steps);

}  // namespace hp::train
