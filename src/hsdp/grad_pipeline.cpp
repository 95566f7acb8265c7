// The HSDP gradient path: post-backward per unit and the root drain.
//
//   per unit N, backward order          shard group (Sd)            replicate group (R)
//   full grads of N  --pad/pack-->  RS(N) [Sd, n] -> [n/Sd]  --+-->  AR(N) of the shard
//                                   (SUM on the wire)          |     (SUM on the wire)
//   fusion off: wait RS(N-1), issue RS(N) per param, issue fused AR(N-1); ARs waited at drain
//   fusion on:  wait AR(N-2), wait RS(N-1) + issue AR(N-1), issue fused RS(N)
//   drain:      wait last RS, issue last AR, wait every AR, TP all-reduce of TP-partial
//               slices, divide once (kAvg: R*Sd), cast, accumulate into the shards' grads
#include <algorithm>

#include <ATen/ATen.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "state.h"

namespace hp::hsdp {

using detail::GradBucket;

std::vector<GradBucket> FullyShard::Impl::issue_reduce_scatter(size_t u) {
  auto& unit = units[u];
  // Buckets keyed by reduce dtype (the group is the unit's shard group for all of them).
  std::map<at::ScalarType, GradBucket> by_dtype;
  std::map<at::ScalarType, std::vector<at::Tensor>> packed;
  for (size_t i : unit.params) {
    auto& p = params[i];
    const auto dtype = options.reduce_dtype.value_or(p.full.scalar_type());
    auto& b = by_dtype[dtype];
    b.unit = u;
    b.dtype = dtype;
    b.params.push_back(i);
    b.offsets.push_back(b.numel);
    b.numel += p.shard_numel();
    auto grad = p.full.grad();
    packed[dtype].push_back(detail::padded_grad(p, grad, sd, dtype));
    // Free the full gradient and the full parameter before communicating (lower peak).
    p.full.mutable_grad() = at::Tensor();
  }
  reshard(u);
  std::vector<GradBucket> out;
  auto& shard = *groups.shard;
  for (auto& [dtype, b] : by_dtype) {
    record("issue RS", unit.name);
    if (options.comm_fusion) {
      b.rs.push_back(
          comm::reduce_scatter_async(shard, at::cat(packed[dtype], 1), 0, comm::ReduceOp::kSum));
    } else {
      for (auto& g : packed[dtype])
        b.rs.push_back(comm::reduce_scatter_async(shard, g, 0, comm::ReduceOp::kSum));
    }
    out.push_back(std::move(b));
  }
  return out;
}

void FullyShard::Impl::finish_reduce_scatter(GradBucket& b) {
  record("wait RS", units[b.unit].name);
  std::vector<at::Tensor> parts;
  for (auto& h : b.rs)
    parts.push_back(timed_wait(h).reshape({-1}));
  b.rs.clear();
  b.reduced = parts.size() == 1 ? parts[0] : at::cat(parts);
}

// After the RS: add a kept partial and issue the AR, or keep it as the partial (accumulation
// without AR), or (R == 1) hand it to the drain.
void FullyShard::Impl::after_reduce_scatter(GradBucket b) {
  const auto key = std::make_pair(b.unit, b.dtype);
  if (r > 1 && !requires_all_reduce) {
    auto it = partials.find(key);
    if (it == partials.end()) {
      partials[key] = b.reduced;
    } else {
      it->second.add_(b.reduced);
    }
    return;
  }
  if (auto it = partials.find(key); it != partials.end()) {
    b.reduced = b.reduced + it->second;
    partials.erase(it);
  }
  if (r == 1) {
    ready.push_back(std::move(b));
    return;
  }
  record("issue AR", units[b.unit].name);
  b.ar = comm::all_reduce_async(*groups.replicate, b.reduced, comm::ReduceOp::kSum);
  if (!options.pipeline) {
    record("wait AR", units[b.unit].name);
    b.reduced = timed_wait(b.ar);
    ready.push_back(std::move(b));
    return;
  }
  ar_in_flight.push_back(std::move(b));
}

void FullyShard::Impl::post_backward(size_t u) {
  auto& unit = units[u];
  HP_INTERNAL_ASSERT(!unit.reduced, "post-backward of unit twice in one backward");
  unit.reduced = true;
  unit.armed = false;
  if (!options.pipeline) {  // baseline: every collective waited right after it is issued
    for (auto& b : issue_reduce_scatter(u)) {
      finish_reduce_scatter(b);
      after_reduce_scatter(std::move(b));
    }
    return;
  }
  if (options.comm_fusion) {
    for (auto& b : ar_in_flight) {  // AR(N-2)
      record("wait AR", units[b.unit].name);
      b.reduced = timed_wait(b.ar);
      ready.push_back(std::move(b));
    }
    ar_in_flight.clear();
    auto previous = std::move(rs_in_flight);  // RS(N-1): wait, issue AR(N-1)
    rs_in_flight.clear();
    for (auto& b : previous) {
      finish_reduce_scatter(b);
      after_reduce_scatter(std::move(b));
    }
    rs_in_flight = issue_reduce_scatter(u);  // RS(N)
    return;
  }
  auto previous = std::move(rs_in_flight);
  rs_in_flight.clear();
  for (auto& b : previous)
    finish_reduce_scatter(b);              // wait RS(N-1)
  rs_in_flight = issue_reduce_scatter(u);  // issue RS(N)
  for (auto& b : previous)
    after_reduce_scatter(std::move(b));  // issue AR(N-1); its wait is the drain's
}

void FullyShard::Impl::drain() {
  const auto t0 = std::chrono::steady_clock::now();
  record("drain begin", "");
  // Units whose post-backward never fired (no gradient reached some parameter) reduce now, in
  // backward order, so every rank issues the same collectives.
  for (size_t k = units.size(); k-- > 0;) {
    if (!units[k].reduced) post_backward(k);
  }
  auto last = std::move(rs_in_flight);
  rs_in_flight.clear();
  for (auto& b : last) {
    finish_reduce_scatter(b);
    after_reduce_scatter(std::move(b));
  }
  for (auto& b : ar_in_flight) {
    record("wait AR", units[b.unit].name);
    b.reduced = timed_wait(b.ar);
    ready.push_back(std::move(b));
  }
  ar_in_flight.clear();
  apply_ready();
  for (auto& unit : units) {
    unit.reduced = false;
    unit.armed = false;
    unit.pending_grads = 0;
  }
  drain_queued = false;
  ++stats.backwards;
  record("drain end", "");
  stats.drain_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void FullyShard::Impl::apply_ready() {
  if (ready.empty()) return;
  // TP-partial slices: one fused all-reduce across TP, before anything accumulates.
  if (groups.tp && groups.tp->size() > 1) {
    std::vector<at::Tensor> slices;
    for (auto& b : ready) {
      for (size_t k = 0; k < b.params.size(); ++k) {
        if (params[b.params[k]].tp_partial_grad) {
          slices.push_back(b.reduced.narrow(0, b.offsets[k], params[b.params[k]].shard_numel()));
        }
      }
    }
    if (!slices.empty()) {
      record("issue TP AR", "");
      auto summed = comm::all_reduce(*groups.tp, at::cat(slices), comm::ReduceOp::kSum);
      int64_t at = 0;
      for (auto& s : slices) {
        s.copy_(summed.narrow(0, at, s.numel()));
        at += s.numel();
      }
    }
  }
  const double divisor = options.reduce_op == ReduceOp::kAvg ? static_cast<double>(r * sd) : 1.0;
  at::NoGradGuard no_grad;
  for (auto& b : ready) {
    for (size_t k = 0; k < b.params.size(); ++k) {
      auto& p = params[b.params[k]];
      auto g = b.reduced.narrow(0, b.offsets[k], p.shard_numel())
                   .view(p.shard.sizes())
                   .to(p.shard.scalar_type());  // cast first: divide in the parameter dtype
      if (divisor != 1.0) g = g / divisor;
      if (p.shard.grad().defined()) {
        p.shard.mutable_grad().add_(g);
      } else {
        p.shard.mutable_grad() = g.clone(at::MemoryFormat::Contiguous);
      }
    }
  }
  ready.clear();
}

}  // namespace hp::hsdp
