// Context parallelism for linear-attention layers (GDN, KDA; attention/linear_host.h): the two
// full-layer modes of the source design.
//
//   ulysses        one packed seq->head all-to-all of this rank's head group's channels
//                  (q, k, v, beta, gate), the short convolution and the delta rule over the full
//                  sequence on P-th of the heads, head->seq all-to-all back. Heads % cp == 0.
//   state_passing  every rank keeps its contiguous shard: the conv halo (the previous rank's last
//                  w-1 pre-convolution rows), one run of the delta rule over the shard that
//                  gives its output and final state as affine maps of any initial state
//                  (out = out0 + P h, final = M h + S; float32 at least), the initial state h as
//                  the fold of the summaries [S | M] of the ranks before it, then out0 + P h.
//                  state_exchange: all_gather (one all-gather of [S | M], no serialization) or
//                  p2p (the chain: P-1 ring steps, rank r's state exact after r of them).
// schedule async: the exchange that precedes output() starts, and the output gate's projection
// (project_out_gate) runs while it travels, forward and (its weight-gradient GEMMs) backward:
//   ulysses        the packed seq->head all-to-all of the projected channels
//   state_passing  the summaries' all-gather (all_gather) or the chain's first shift (p2p; the
//                  later hops wait for the fold); the conv halo, w-1 rows, stays blocking
// sync: every collective blocks where it is issued. Both give the same numbers.
// Every exchange is differentiable: outputs and every gradient equal the single-process layer.
// The exchanges and the state-passing core are shared with the mixer-level entry
// (cp/linear_mixer.h: linear_mixer_cp), so each exists once.
#pragma once

#include <memory>
#include <string>

#include "hp/attention/linear_host.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"

namespace hp::cp {

struct LinearCPOptions {
  std::string module_path;                    // messages and the interceptor id
  std::string mode = "state_passing";         // state_passing | ulysses
  std::string state_exchange = "all_gather";  // all_gather | p2p (state_passing)
  CPSchedule schedule = CPSchedule::kSync;    // async: see the sketch above
};

// Checks (before any collective; messages name field, value and fix): the mode and exchange
// names, head divisibility for ulysses. Installs the mode into `host`; applying a different
// mode twice is an error. Returns the apply log line.
std::string apply_linear_cp(attention::LinearHost& host, const attention::LinearLayerShape& shape,
                            const LinearCPOptions& options,
                            const std::shared_ptr<const CPTopology>& topology);

namespace detail {
std::shared_ptr<attention::LinearInterceptor> make_linear_ulysses(
    const LinearCPOptions& options, std::shared_ptr<const CPTopology> topology);
std::shared_ptr<attention::LinearInterceptor> make_linear_state_passing(
    const LinearCPOptions& options, std::shared_ptr<const CPTopology> topology);
}  // namespace detail

}  // namespace hp::cp
