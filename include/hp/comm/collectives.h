// Collectives over a Group, each sync or async (CommHandle).
//
// Every call checks its input before any communication (undefined tensor, dim out of range,
// size not divisible by the group size) and throws hp::Error naming the op, the value and what
// would be valid. Every call counts the bytes the transport handed its backend for other ranks
// (PendingOp::bytes_sent; never a formula) into the group's CommContext, with the op's formula
// (theory_bytes_per_rank) beside it, and appends to its CollectiveRecorder and Tracer when
// present. Tensors stay on their device (results are allocated like the inputs).
// All ranks of the group must issue the same collectives in the same order.
//
// Dtypes: what the backend cannot move natively (bfloat16 on Gloo) travels as raw bytes,
// bit-exact; what it cannot reduce natively is reduced in float32 and cast back.
// Results are new, contiguous tensors; inputs are never modified.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include "hp/comm/comm_handle.h"
#include "hp/comm/group.h"
#include "hp/comm/types.h"

namespace hp::comm {

// Concatenation along `dim` of every rank's `t` in group-rank order: dim grows by P.
at::Tensor all_gather(Group& group, const at::Tensor& t, int64_t dim);
CommHandle all_gather_async(Group& group, const at::Tensor& t, int64_t dim);

// Reduce over ranks, then rank r keeps chunk r of `dim` (size must divide by P): dim shrinks
// by P. Native when the backend has it, else one all-to-all + local reduction (same (P-1)/P
// volume; never all-reduce + slice).
at::Tensor reduce_scatter(Group& group, const at::Tensor& t, int64_t dim,
                          ReduceOp op = ReduceOp::kSum);
CommHandle reduce_scatter_async(Group& group, const at::Tensor& t, int64_t dim,
                                ReduceOp op = ReduceOp::kSum);

// Splits `t` into P chunks along split_dim (size must divide by P), sends chunk j to rank j,
// and concatenates the received chunks along concat_dim in rank order: split_dim shrinks by P,
// concat_dim grows by P. split_dim == concat_dim is a plain chunk exchange.
at::Tensor all_to_all(Group& group, const at::Tensor& t, int64_t split_dim, int64_t concat_dim);
CommHandle all_to_all_async(Group& group, const at::Tensor& t, int64_t split_dim,
                            int64_t concat_dim);

// Variable split sizes along dim 0 (expert parallelism's token dispatch): rows
// [sum(send_rows[:j]), +send_rows[j]) of `t` go to rank j; the result holds rank i's rows at
// [sum(recv_rows[:i]), +recv_rows[i]), in rank order, and keeps t's other dims. sum(send_rows)
// must be t.size(0); recv_rows[i] must be what rank i sends this rank (all_to_all_counts). The
// formula beside the counted bytes is the rows addressed to other ranks.
at::Tensor all_to_all_v(Group& group, const at::Tensor& t, const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows);
CommHandle all_to_all_v_async(Group& group, const at::Tensor& t,
                              const std::vector<int64_t>& send_rows,
                              const std::vector<int64_t>& recv_rows);
// The counts every rank addresses to this one: recv[i] = rank i's send[this rank] (one
// all-to-all of P int64 values; counted as traffic).
std::vector<int64_t> all_to_all_counts(Group& group, const std::vector<int64_t>& send);

// Elementwise reduction over ranks; every rank gets the result (out of place).
at::Tensor all_reduce(Group& group, const at::Tensor& t, ReduceOp op = ReduceOp::kSum);
CommHandle all_reduce_async(Group& group, const at::Tensor& t, ReduceOp op = ReduceOp::kSum);

// Paired point-to-point. Peers are group ranks. Every send needs the matching recv on the
// peer with the same shape and dtype.
void send(Group& group, const at::Tensor& t, int dst);
CommHandle send_async(Group& group, const at::Tensor& t, int dst);
// `options` give the dtype and device of the received tensor (a dtype converts implicitly).
at::Tensor recv(Group& group, at::IntArrayRef shape, const at::TensorOptions& options, int src);
CommHandle recv_async(Group& group, at::IntArrayRef shape, const at::TensorOptions& options,
                      int src);

// Sends `t` to `peer` and returns what `peer` sent (same shape and dtype on both sides).
// peer == group.rank() returns a copy of `t`.
at::Tensor exchange(Group& group, const at::Tensor& t, int peer);

// One ring step: sends `t` to group rank (rank + offset) mod P and returns what rank
// (rank - offset) mod P sent (same shape and dtype on every rank). offset = 0 mod P returns a
// copy of `t`.
at::Tensor shift(Group& group, const at::Tensor& t, int offset);

void barrier(Group& group);

}  // namespace hp::comm
