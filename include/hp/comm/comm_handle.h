// CommHandle: one asynchronous collective in flight.
//
// Contract:
//   * owns every buffer the collective reads or writes until it completes (a handle dropped
//     without wait() still waits in its destructor, so no buffer is freed under the backend);
//   * wait() blocks, rethrows a backend failure as hp::CommError naming op, group and rank,
//     then runs the re-layout continuation exactly once and returns its result;
//   * a second wait() is an error (hp::Error), as is wait() on an empty handle.
// Move-only.
#pragma once

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

#include "hp/comm/types.h"

namespace hp::comm {

class Group;
class PendingOp;

class CommHandle {
 public:
  using Continuation = std::function<at::Tensor()>;

  CommHandle();
  // `continuation` runs once, after the backend finished, and produces wait()'s result.
  // `buffers` are kept alive until completion.
  CommHandle(Group& group, OpKind op, int64_t bytes_sent, std::unique_ptr<PendingOp> pending,
             std::vector<at::Tensor> buffers, Continuation continuation);
  // An already-finished handle (e.g. a group of one rank).
  static CommHandle ready(Group& group, OpKind op, at::Tensor result);

  CommHandle(CommHandle&&) noexcept;
  CommHandle& operator=(CommHandle&&) noexcept;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle();

  at::Tensor wait();
  // This handle, with `next` applied to the result wait() returns (a reshape or a reduction
  // of what arrived); only a handle that has not been waited.
  CommHandle then(std::function<at::Tensor(const at::Tensor&)> next) &&;
  bool valid() const;         // holds a collective that has not been waited yet
  bool is_completed() const;  // the backend finished (wait() would not block)

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace hp::comm
