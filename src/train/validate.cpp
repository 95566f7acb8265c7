#include "validate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "hf_io.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"

namespace hp::train {
namespace {

// The reference's max |loss difference| over the run and max relative gradient difference
// after step 1, against the distributed run's.
Validation compare_with_reference(const Runner& run, const Corpus& corpus,
                                  const std::vector<StepMetrics>& steps) {
  const TrainOptions& o = run.o;
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto solo = comm::World::in_process(0, 1, store);
  comm::DeviceMesh solo_mesh(solo, {{"dp_replicate", 1}, {"dp_shard", 1}, {"cp", 1}, {"tp", 1}});
  TrainOptions ro = o;
  ro.validate = true;
  ro.test_nan_step = 0;                              // the fault hook is the distributed run's only
  ro.batch = o.batch * o.dp_shard * o.dp_replicate;  // the union of the data-parallel rows
  ro.dp_shard = ro.dp_replicate = 1;
  Runner ref(ro, solo_mesh, std::nullopt);
  ref.make_optimizer(nullptr);
  if (!o.init_from.empty()) load_hf_checkpoint(ref, nullptr, o.init_from);
  Validation v;
  for (int64_t step = 1; step <= o.steps; ++step) {
    const double loss = ref.forward_backward(step, corpus);
    if (steps[step - 1].skipped) {
      // The run dropped this step's update (--nan-policy skip-step), so the reference does too;
      // the run's loss of the step is the fault's, and its gradients are not compared.
      ref.discard_grads();
      ref.first_grads.clear();
      continue;
    }
    if (v.grad_step == 0) v.grad_step = step;
    ref.clip_and_step(step);
    v.max_abs_loss_diff = std::max(v.max_abs_loss_diff, std::abs(loss - steps[step - 1].loss));
  }
  for (const auto& [n, g] : run.first_grads) {
    auto r = ref.first_grads.at(n);
    HP_CHECK(r.sizes() == g.sizes(), "validate: gradient '", n, "' is ", g.sizes(), " here but ",
             r.sizes(), " in the single-process run");
    const double rel = ((g - r).norm() / (r.norm() + 1e-12)).item<double>();
    v.max_rel_grad_diff = std::max(v.max_rel_grad_diff, rel);
  }
  return v;
}

}  // namespace

Validation validate_against_reference(const comm::World& world, const Runner& run,
                                      const Corpus& corpus, const std::vector<StepMetrics>& steps) {
  Validation v;
  if (world.rank() == 0) {
    v = compare_with_reference(run, corpus, steps);
    const int64_t skipped =
        std::count_if(steps.begin(), steps.end(), [](const StepMetrics& m) { return m.skipped; });
    const std::string skipped_text =
        skipped == 0 ? std::string()
                     : common::str_cat(" (", skipped, " skipped step", skipped == 1 ? "" : "s",
                                       " not compared)");
    if (v.grad_step == 0) {
      std::printf("hp-train: validate: every step was skipped; nothing was compared\n");
    } else {
      std::printf(
          "hp-train: validate: max |loss - reference| over %lld steps = %.3g; max "
          "relative gradient difference after step %lld = %.3g%s\n",
          (long long)(run.o.steps - skipped), v.max_abs_loss_diff, (long long)v.grad_step,
          v.max_rel_grad_diff, skipped_text.c_str());
    }
  }
  comm::barrier(world.group());
  return v;
}

}  // namespace hp::train
