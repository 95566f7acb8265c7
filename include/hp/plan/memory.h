// Per-rank memory of a planned layout, estimated before anything is allocated (DESIGN section
// 9: every static check before the first collective), and the check against the machine.
//
//   auto est = estimate_memory(model::footprint(config), plan_options);   // bytes per rank
//   check_memory(est, ranks_on_this_machine, machine_memory(), "hp-train");
//
// What is counted per rank (fp32 by default):
//   parameters   the rank's elements after TP (and HSDP: / (dp_shard x cp)); experts / ep
//   gradients    as many
//   optimizer    AdamW's two moments: twice as many
//   activations  what one micro-batch keeps for backward: per token of the rank's sequence shard
//                (batch x seq_len / cp) and layer, the model's saved tensors (TP splits the head
//                and MLP parts), CP's gathered K/V (all_gather) or exchanged Q/K/V/O (Ulysses),
//                the embedding and head (logits and their softmax); with recompute only each
//                layer's input plus one layer's full set; plus one layer's set of gradients in
//                backward
//   transient    the larger of building the model (each weight built whole before TP slices it;
//                the planner's probe of the full model) and HSDP's gathered units (two units with
//                prefetch, and one unit's unsharded gradients)
//   runtime      the process itself (LibTorch, Gloo, OpenMP): a constant measured on this build
// It is an estimate, meant to be within a factor of 2 of the measured peak RSS: enough to refuse
// a layout that cannot fit before it is OOM-killed, and to say what to change.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/plan/plan.h"

namespace hp::plan {

// Parameter elements of one group (an HSDP unit): those TP splits and those every TP rank holds.
struct ParamGroup {
  int64_t tp_sharded = 0;
  int64_t replicated = 0;
  int64_t expert = 0;  // MoE experts: split by EP (ep_size), not by TP or HSDP
};

// What the estimate needs of a model, from its configuration alone (nothing allocated).
struct ModelFootprint {
  std::vector<ParamGroup> units;  // HSDP units, root first; together every parameter
  int64_t largest_param = 0;      // elements of the largest weight (built whole, then sliced)
  int64_t layers = 0;
  // Activation elements one layer keeps per token for backward: the part TP splits (heads, MLP
  // width) and the rest (hidden-size tensors).
  int64_t layer_act_tp = 0;
  int64_t layer_act = 0;
  int64_t layer_input = 0;   // what recompute keeps of a layer per token (its input)
  int64_t q_per_token = 0;   // Q elements per token and layer, before TP (CP exchanges)
  int64_t kv_per_token = 0;  // K plus V elements per token and layer, before TP
  int64_t head_act = 0;      // per token: the embedding, final norm, logits, softmax, their grads
  bool recompute = false;
  int64_t element_size = 4;
};

struct MemoryEstimate {
  int64_t parameters = 0, gradients = 0, optimizer = 0, activations = 0, transient = 0, runtime = 0;
  int64_t total() const {
    return parameters + gradients + optimizer + activations + transient + runtime;
  }
  // "1.2 GiB (parameters 300 MiB, gradients 300 MiB, AdamW state 600 MiB, ...)"
  std::string describe() const;
};

// The process's own footprint (LibTorch, Gloo, OpenMP), measured: ~165 MiB RSS for a tiny model.
constexpr int64_t kRuntimeBytes = int64_t{160} << 20;

// The estimate for one rank of the layout `options` (tp_size, cp_size, cp_config, dp_shard,
// dp_replicate, seq_len, batch = sequences per rank and micro-batch).
MemoryEstimate estimate_memory(const ModelFootprint& model, const PlanOptions& options);

// What the ranks of this machine may use together, and where that number comes from.
struct MachineMemory {
  int64_t bytes = 0;
  std::string source;  // "MemAvailable in /proc/meminfo", "the cgroup limit ...", "--memory-limit"
};
// MemAvailable (MemTotal on old kernels), or less when a cgroup (v2 memory.max, v1
// memory.limit_in_bytes) leaves less; bytes = 0 when none can be read.
MachineMemory machine_memory();

// Refuses (hp::Error, prefixed with `tool`) a layout whose `per_rank` x `ranks` (plus `extra`
// bytes, e.g. a single-process reference, which the message names as `extra_what`) exceeds
// `available`, naming the estimate, the limit and the options to change. A no-op when
// available.bytes == 0.
void check_memory(const MemoryEstimate& per_rank, int64_t ranks, const MachineMemory& available,
                  const std::string& tool, int64_t extra = 0,
                  const std::string& extra_what = "the reference");

// "12 KiB", "512 MiB", "1.5 GiB".
std::string format_bytes(int64_t bytes);

}  // namespace hp::plan
