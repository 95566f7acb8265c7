// Vocabulary of the comm layer: collective kinds and reduction ops.
#pragma once

#include <chrono>
#include <string>

namespace hp::comm {

// The group timeout (rendezvous and every collective) of every World, group and tool unless
// told otherwise: WorldOptions, C10dTransportOptions, the tools' --timeout. One number, the one
// the README documents (DESIGN section 4).
inline constexpr std::chrono::seconds kDefaultTimeout{300};

enum class OpKind { kAllGather, kReduceScatter, kAllToAll, kAllReduce, kSend, kRecv, kBarrier };

// Reductions. kAvg is a SUM on the wire followed by one division by the group size.
enum class ReduceOp { kSum, kAvg, kMax, kMin };

// "all_gather", "reduce_scatter", "all_to_all", "all_reduce", "send", "recv", "barrier".
const char* op_name(OpKind op);

// Bytes one rank sends for `op` over a group of `group_size` ranks when its input holds
// `bytes_in` bytes (DESIGN section 4; the benches compare the counters with these):
//   all_gather      (P-1)   * in   (every rank's shard must reach the P-1 others; ring)
//   reduce_scatter  (P-1)/P * in   (native ring, or one all-to-all + local sum)
//   all_to_all      (P-1)/P * in   (the chunks addressed to other ranks)
//   all_reduce      2(P-1)/P * in  (ring: reduce-scatter then all-gather)
//   send            in ;  recv, barrier  0
int64_t theory_bytes_per_rank(OpKind op, int64_t bytes_in, int group_size);

}  // namespace hp::comm
