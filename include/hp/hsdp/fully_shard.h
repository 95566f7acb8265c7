// HSDP: fully sharded data parallel over a 2-D data mesh (dp_replicate R, shard Sd) (DESIGN
// section 8). The shard dimension also spans the CP ranks: parameters are replicated over CP, so
// their gradients reduce over CP as well. TP-sharded parameters are sharded further on top (a
// unit's parameters are whatever this rank's modules hold).
//
//   FullyShard fs(units, groups, options);       // units[0] is the root (never resharded
//                                                // after forward); the rest in forward order
//   y = fs.forward_root([&] { ...; x = fs.forward_unit(1, x, layer_fn); ...; return out; });
//   loss(y).backward();                          // post-backward pipeline + one root drain
//   optimizer over fs.sharded_parameters()       // shards carry the reduced gradients
//
// Parameters: chunked on dim 0 into Sd pieces (rows padded up to a multiple of Sd, never
// refused); shard rank s keeps rows [s*c, (s+1)*c). Between uses a module's parameter keeps its
// full shape but owns no memory; the unit's forward all-gathers it (one fused all-gather per
// unit and dtype, prefetching the next unit asynchronously) and frees it afterwards
// (`reshard_after_forward`); the backward gathers again (prefetching the previous unit).
//
// Gradients: SUM on the wire, one division at the end (kAvg = mean over R*Sd ranks):
// reduce-scatter over the shard group, then all-reduce of the shard over the replicate group.
//   comm_fusion = false, per unit N in backward order:
//     wait RS(N-1) -> issue RS(N) (one per parameter) -> issue the fused AR(N-1) async.
//   comm_fusion = true (buckets keyed by (group, dtype)):
//     wait AR(N-2) -> wait RS(N-1), issue AR(N-1) -> issue the fused RS(N).
//   Root drain, queued once per outermost backward by the root's first backward hook (a
//   recompute's inner backward never drains): post-backward of units that never fired, wait the
//   last RS, issue the last AR, wait every AR, apply the gradients to the shards (cast to the
//   parameter dtype, accumulated), then all-reduce TP-partial gradients across TP.
//   Every buffer stays alive until its collective completes (CommHandle owns it).
//
// Gradient accumulation: set_requires_all_reduce(false) for the micro-steps that should skip
// the replicate all-reduce; their reduce-scattered shards are kept and added before the next
// all-reduce. With R == 1 there is no all-reduce and gradients accumulate in the shards.
//
// All ranks must run the same units in the same order, and every parameter must get a gradient
// on every rank or on none (the collectives are matched by order). Do not wrap forward_unit in
// an outer recompute: use its `recompute` argument. Once sharded, a model's parameters hold no
// memory outside forward/backward; shard a model once, and keep the FullyShard alive as long
// as the model is used.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/comm/group.h"

namespace hp::hsdp {

enum class ReduceOp { kAvg, kSum };

struct HsdpOptions {
  bool comm_fusion = false;
  bool reshard_after_forward = true;  // non-root units; the root stays gathered until backward
  bool prefetch = true;               // async all-gather of the next unit (forward and backward)
  // false: the baseline that waits every collective right after issuing it (benchmarks).
  bool pipeline = true;
  ReduceOp reduce_op = ReduceOp::kAvg;
  std::optional<at::ScalarType> reduce_dtype;  // default: each parameter's dtype
  bool record_schedule = false;                // keep the event list (schedule())
};

struct HsdpGroups {
  comm::GroupPtr shard;      // Sd ranks (dp_shard x cp), consecutive
  comm::GroupPtr replicate;  // R ranks, stride Sd
  comm::GroupPtr tp;         // null without TP
};

struct UnitParam {
  std::string name;              // full name, e.g. "layers.0.mlp.up_proj.weight"
  at::Tensor param;              // the module's registered leaf (requires grad)
  bool tp_partial_grad = false;  // replicated over TP but its gradient is a per-rank partial
};

struct UnitSpec {
  std::string name;  // "root", "layers.0", ...
  std::vector<UnitParam> params;
};

struct HsdpStats {
  int64_t backwards = 0;    // drains run (one per outermost backward)
  double exposed_s = 0;     // time blocked in waits of HSDP's async collectives (AG, RS, AR)
  double drain_s = 0;       // time inside drains
  int64_t shard_numel = 0;  // this rank's parameter elements (shards, padding included)
  int64_t full_numel = 0;   // this rank's unsharded parameter elements (TP-local)
  int64_t resident_unsharded_numel = 0;  // full parameters currently holding memory
};

// Bytes this rank sends in one forward + backward that ends with the replicate all-reduce (a
// step, or its last micro-step), by the comm layer's formulas; includes the TP all-reduce of
// TP-partial gradients.
struct ByteFormula {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;
};

class FullyShard {
 public:
  FullyShard(std::vector<UnitSpec> units, HsdpGroups groups, HsdpOptions options = {});
  ~FullyShard();
  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;

  // The root's forward: gathers the root (and prefetches unit 1), runs `fn`, and hooks the
  // output so that the first backward through it queues the drain. An earlier forward that can
  // never be backpropagated (`fn` threw on every rank, or its output's graph was dropped) is
  // forgotten first: its units are disarmed and resharded. A forward whose output is still held
  // and not yet backpropagated is an error (micro-batches in flight are not supported).
  at::Tensor forward_root(const std::function<at::Tensor()>& fn);
  // Unit `index` (>= 1) on `x`: gather (waiting the prefetch), prefetch the next, run `fn`
  // (recomputed in backward when `recompute`), free after forward, hook the backward.
  at::Tensor forward_unit(size_t index, const at::Tensor& x,
                          const std::function<at::Tensor(const at::Tensor&)>& fn,
                          bool recompute = false);
  // The same for a unit with several outputs (the first is the activation the next unit takes;
  // the others, e.g. auxiliary losses, are returned in the graph, recomputed with the unit).
  std::vector<at::Tensor> forward_unit_outputs(
      size_t index, const at::Tensor& x,
      const std::function<std::vector<at::Tensor>(const at::Tensor&)>& fn, bool recompute = false);

  void set_requires_all_reduce(bool value);

  // The optimizer's parameters: (name, shard) per parameter, in unit order.
  std::vector<std::pair<std::string, at::Tensor>> sharded_parameters() const;
  // Rows [first_row, first_row + valid rows) of the full parameter this rank's shard holds.
  int64_t shard_first_row(const std::string& name) const;
  int64_t shard_valid_rows(const std::string& name) const;
  // Collective over the shard group: the unpadded full gradient / parameter.
  at::Tensor full_gradient(const std::string& name);
  at::Tensor full_parameter(const std::string& name);

  const std::vector<std::string>& schedule() const;  // events, when record_schedule
  void clear_schedule();
  HsdpStats stats() const;
  ByteFormula bytes_per_step() const;
  std::string describe() const;  // "HSDP R=2 x Sd=2, 3 units, fusion off, ..."

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hp::hsdp
