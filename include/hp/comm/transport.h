// The backend seam: raw collectives over contiguous buffers, issued asynchronously.
//
// A Transport knows nothing of dims, dtypes policies, counters or traces; collectives.h does
// all of that once, above it. Implementations:
//   * c10d (Gloo on CPU, NCCL when the found LibTorch has it)  -> make_c10d_transport
//   * local: a group of one rank, or a *fake* group that records and does not communicate
//     (FakeProcessGroup-style semantics, see make_fake_transport)      -> transport_local.cpp
// Contract for every call: all ranks of the group issue the same calls in the same order.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "hp/comm/types.h"

namespace c10d {
class Store;
class ProcessGroup;
}  // namespace c10d

namespace hp::comm {

// One in-flight backend operation.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  // Blocks until done; rethrows the backend's error (dead peer, timeout, transport failure).
  virtual void wait() = 0;
  // Whether wait() would not block. Gloo's point-to-point works report completion only once
  // waited, so their operations are watched by a thread from the launch on: the answer turns
  // true as soon as they land (a moment after, on a busy machine), so ask again later.
  virtual bool is_completed() = 0;
  // Monotonic microseconds at which the backend finished, or -1 when it cannot tell.
  virtual int64_t completed_at_us() const { return -1; }
  // Bytes of the tensors this call handed to the backend for other ranks (the traffic counters
  // read this; they never compute a formula): all_gather its input once per peer, all_to_all
  // and reduce_scatter the chunks addressed to other ranks, send its tensor, all_reduce the
  // buffer it contributes (the backend's ring then moves 2(P-1)/P of it per rank), recv and
  // barrier nothing.
  int64_t bytes_sent() const { return bytes_sent_; }
  void set_bytes_sent(int64_t bytes) { bytes_sent_ = bytes; }

 private:
  int64_t bytes_sent_ = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string backend_name() const = 0;
  // Whether this backend implements `op` at all (planners check this before any collective).
  virtual bool supports(OpKind /*op*/) const { return true; }
  virtual bool has_native_reduce_scatter() const { return false; }
  // Whether the backend reduces this dtype natively (else collectives.h upcasts to float).
  virtual bool reduces_dtype(at::ScalarType dtype) const = 0;
  // Whether the backend moves this dtype natively (else collectives.h reinterprets the bytes).
  virtual bool moves_dtype(at::ScalarType dtype) const = 0;

  // `out` is [P, *in.shape], contiguous: rank i's `in` lands in out[i].
  virtual std::unique_ptr<PendingOp> all_gather(at::Tensor out, at::Tensor in) = 0;
  // `in` and `out` are [P, ...] contiguous: in[j] goes to rank j, out[i] comes from rank i.
  virtual std::unique_ptr<PendingOp> all_to_all(at::Tensor out, at::Tensor in) = 0;
  // Variable split sizes along dim 0 (`in`, `out` contiguous): rows
  // [sum(in_rows[:j]), +in_rows[j]) of `in` go to rank j; rank i's rows land at
  // [sum(out_rows[:i]), +out_rows[i]) of `out`. Every rank's in_rows[j] equals rank j's out_rows
  // of this rank (the caller exchanged the counts). The default throws: not supported.
  virtual std::unique_ptr<PendingOp> all_to_all_v(at::Tensor out, at::Tensor in,
                                                  std::vector<int64_t> out_rows,
                                                  std::vector<int64_t> in_rows);
  // In place on contiguous `inout`. op is kSum, kMax or kMin (kAvg is handled above).
  virtual std::unique_ptr<PendingOp> all_reduce(at::Tensor inout, ReduceOp op) = 0;
  // Native only (has_native_reduce_scatter): `in` is [P, *out.shape] contiguous.
  virtual std::unique_ptr<PendingOp> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op);
  virtual std::unique_ptr<PendingOp> send(at::Tensor t, int dst, int tag) = 0;
  virtual std::unique_ptr<PendingOp> recv(at::Tensor t, int src, int tag) = 0;
  virtual std::unique_ptr<PendingOp> barrier() = 0;
};

struct C10dTransportOptions {
  // Any c10d backend the found LibTorch provides: "gloo" (always), "nccl" where LibTorch was
  // built with it (tensors stay on their CUDA device). available_c10d_backends() lists them.
  std::string backend = "gloo";
  std::string hostname = "127.0.0.1";  // interface Gloo binds to
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

// Rendezvous over `store` (a PrefixStore unique to the group) and connect the group's ranks.
// Blocks until every member has arrived or the timeout passes.
std::unique_ptr<Transport> make_c10d_transport(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int size,
                                               const C10dTransportOptions& options);

// Over a c10d process group that already exists (e.g. a torch.distributed group handed in from
// Python): no rendezvous, its ranks and its backend are the group's. The group's own timeout
// applies to its collectives. Calls are issued on it in program order, interleaving with
// whatever else its owner issues on it (the same-order contract covers both).
std::unique_ptr<Transport> make_process_group_transport(
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group);

// The c10d backends this build can create ("gloo", and "nccl" when LibTorch has it).
std::vector<std::string> available_c10d_backends();

// A group of one rank: collectives are local copies.
std::unique_ptr<Transport> make_self_transport();

// A recording fake group of `size` ranks that never communicates: all_gather fills every slot
// with the local input, all_to_all keeps the local chunks in place (all_to_all_v: slot 0's rows
// stay, every other slot is zero), all_reduce and
// reduce_scatter see only the local contribution, recv yields zeros. Shapes are exact, values are
// placeholders; use it to test schedules and planners without peers.
std::unique_ptr<Transport> make_fake_transport(int size);

}  // namespace hp::comm
