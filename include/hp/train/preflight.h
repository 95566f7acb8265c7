// Everything hp-train can check before step 1 without a collective and without allocating the
// model (issue 13): the options' values, the output paths and the memory the layout needs.
// train() runs it on every rank first; hp-train also runs it before it spawns local ranks, so a
// bad flag fails in a fraction of a second, naming the option to change.
#pragma once

#include <string>

#include "hp/plan/memory.h"
#include "hp/plan/plan.h"
#include "hp/train/options.h"

namespace hp::train {

// The values: sizes >= 1, --lr finite and > 0, --checkpoint-every >= 0, --resume with a
// --checkpoint-dir, ...
void check_options(const TrainOptions& options);

// Output paths, each tried for writing (a probe file is created and removed; nothing is left):
// --checkpoint-dir (created when missing) and --trace on every rank, --metrics-json on rank 0.
// Errors read "hp-train: cannot write --FLAG 'PATH': why".
void check_output_paths(const TrainOptions& options, int rank);

// The planner's estimate of one rank of this run (plan::estimate_memory of the model's
// footprint and the layout), before anything is allocated.
plan::MemoryEstimate estimate_memory(const TrainOptions& options);

// The planner's options for this run's layout (mesh sizes, CP, HSDP, linear CP, workload); the
// plan, the memory estimate and the checks all read them from here.
plan::PlanOptions plan_options(const TrainOptions& options);

// The plan of this run over `world_size` ranks: every static check of the layout against the
// model (a probe built from the sizes; nothing communicated). hp-train runs it before it spawns
// local ranks, so a layout error is printed once; train() runs it on every rank.
plan::ShardingPlan plan_layout(const TrainOptions& options, int64_t world_size);

// Refuses a run whose `ranks_on_machine` ranks (plus --validate's single-process reference)
// would exceed the machine's available memory, or options.memory_limit when set.
void check_memory(const TrainOptions& options, int ranks_on_machine);

// All of the above, for world rank `rank` of a job with `ranks_on_machine` ranks on this machine.
void preflight(const TrainOptions& options, int rank, int ranks_on_machine);

// "512M", "2G", "1536K", or a plain byte count: what --memory-limit accepts (and prints).
int64_t parse_size(const std::string& text);
std::string size_option(int64_t bytes);

}  // namespace hp::train
