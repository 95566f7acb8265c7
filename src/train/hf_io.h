// Internal to train/: --init-from (a Hugging Face checkpoint read into this rank's slices of the
// run's parameters) and --export-hf (the trained model gathered tensor by tensor and written by
// rank 0 in the same format).
#pragma once

#include <string>

#include "hp/comm/world.h"
#include "hp/plan/plan.h"
#include "runner.h"

namespace hp::train {

// Copies each of run.params (parameters, or HSDP shards) from the checkpoint in `dir`: this
// rank's TP slice, EP experts and HSDP rows only. `plan` null: a single-process run.
void load_hf_checkpoint(Runner& run, const plan::ShardingPlan* plan, const std::string& dir);

// Collective over the world: every parameter gathered whole (HSDP, TP, EP) one at a time and
// written by rank 0 into dir/model.safetensors with dir/config.json.
void export_hf_checkpoint(const comm::World& world, Runner& run, const plan::ShardingPlan& plan,
                          const std::string& dir);

}  // namespace hp::train
