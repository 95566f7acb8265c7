// The async CP schedule's bookkeeping (DESIGN section 5.6).
//
//   handoff point emits x  --> start the role's collective (comm::start_transfer), one per
//                              piece when the strategy splits x (CPStrategy::split_for_move),
//                              push an AsyncSlot (forward FIFO) and return x wired to its start
//                              node(s). Only piece 0 launches at once; the later pieces are held
//                              until attention has waited for every handoff's piece 0 (or for
//                              a later piece, or for a joined role) and then launch piece 1 of
//                              every handoff, piece 2, ...: group 0's Q0 K0 V0 have the wire to
//                              themselves (a backend that runs two collectives at once would
//                              share it with Q1), and Q1 K1 V1 ... fly while group 0 is
//                              attended
//   attention call         --> pop the slot and finish the transfer: checks that the tensor
//                              reaching attention is the one the handoff emitted (shape, dtype,
//                              identity = same invocation), waits, returns the moved tensor
//   backward               --> the finish node launches the inverse collective and returns; the
//                              start node (the producer side) waits for it and hands the real
//                              gradient to the projection, so each projection's weight-gradient
//                              GEMM waits only for its own collective.
// A slot belongs to one invocation (two micro-batches in flight, or a recompute, each get their
// own); nothing is a single overwritten entry.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/comm/async_transfer.h"
#include "hp/cp/strategy.h"

namespace hp::cp {

struct AsyncSlot {
  QKVRole role = QKVRole::kQ;
  int64_t invocation = 0;
  std::string handoff;  // handoff point name (messages)
  // The role's collectives, launched at the handoff (comm/): one per piece the strategy split
  // the tensor into (CPStrategy::split_for_move), usually one.
  std::vector<comm::AsyncTransferPtr> transfers;
  // The emitted pieces when there are several (the model continues with the handoff's own
  // tensor, wired to them); with one, the emitted tensor is the consumer itself.
  std::vector<at::Tensor> pieces;
  // What the handoff emitted (the consumer must pass exactly this): a weak reference, since the
  // emitted tensor's autograd node owns the slot (a strong one would be a cycle that leaks an
  // unconsumed slot), plus its shape and dtype for messages.
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> produced;
  std::vector<int64_t> produced_sizes;
  at::ScalarType produced_dtype = at::kFloat;
  bool consumed = false;
};

// Per attention module: one forward FIFO of slots per role.
class CPRuntimeState {
 public:
  explicit CPRuntimeState(std::string module_path) : module_(std::move(module_path)) {}

  // Starts one collective per piece of the handoff's tensor x for `role` (pieces: x re-laid
  // out by `split`, CPStrategy::split_for_move; one piece is x itself) and returns the tensor
  // the model continues with: the emitted piece, or with several x itself (no copy) wired to
  // them, its gradient split alike. Pieces after the first launch later (release_held, the
  // top), so `launch` must not refer to state that changes.
  // Throws if a slot of this role from an earlier forward was never consumed.
  using Split = std::function<std::vector<at::Tensor>(const at::Tensor&)>;
  at::Tensor produce(QKVRole role, const std::string& handoff, const at::Tensor& x,
                     const Split& split,
                     const std::function<comm::CommHandle(const at::Tensor&)>& launch,
                     const std::function<comm::CommHandle(const at::Tensor&)>& launch_inverse);

  // Pops the role's slot for `consumer` (the tensor reaching attention) and returns its
  // pieces in flight, in order: wait() on each returns that piece moved, differentiably.
  // Errors: no slot (the handoff did not run), a different tensor than the handoff emitted
  // (not the last transform, or a mismatched invocation), shape/dtype.
  std::vector<comm::InFlight> consume(QKVRole role, const at::Tensor& consumer);
  // The held pieces' launches, in wire order: first_piece_waited after the wait for a
  // handoff's piece 0 (the last of them releases every held piece); release_through(i)
  // before waiting for piece i (every handoff's pieces up to i), release_held before waiting
  // for a whole role. Every rank calls them at the same points of its program, so the
  // collectives start in the same order everywhere.
  void first_piece_waited();
  void release_held();
  void release_through(size_t piece);
  // Deferred (ArrivedFn::defer_later_pieces): first_piece_waited releases nothing; the
  // strategy releases the next piece index of every handoff at a time (release_next, usp: one
  // head group's pieces) or all. Cleared once every held piece has launched.
  void defer_release();
  void release_next();
  // Whether every piece of the role's next slot has landed (waiting would not block); false
  // when none is pending.
  bool arrived(QKVRole role) const;

  // Error listing the slots still queued (called at the end of a module forward); the queue is
  // emptied first, so a failed forward leaves nothing behind.
  void check_drained();
  // Drops every queued slot and held piece without an error (a module forward begins: they
  // belong to one that failed before its end). Blocks until the dropped slots' launched
  // collectives have finished; their held pieces never launch.
  void discard_pending();
  size_t pending() const;

 private:
  // The held launches of pieces launched_through_+1 .. `through` (nullopt: the next piece index
  // only) in wire order (see the top); once none is left, held_ emptied and the deferral
  // cleared. Called under mu_, the caller runs them after unlocking.
  std::vector<std::function<void()>> take_held(std::optional<size_t> through);
  // Empties the queues and the held pieces (the caller destroys the slots, outside mu_).
  std::vector<std::shared_ptr<AsyncSlot>> take_pending();
  // take_held under mu_, then its launches outside it.
  void launch_held(std::optional<size_t> through);

  std::string module_;
  mutable std::mutex mu_;
  std::deque<std::shared_ptr<AsyncSlot>> fifo_[3];
  // Per handoff with several pieces, in handoff order: its pieces 1.. not yet launched.
  std::vector<std::vector<std::function<void()>>> held_;
  size_t launched_through_ = 0;        // pieces 1 .. this of every handoff in held_ launched
  int64_t first_pieces_unwaited_ = 0;  // of the handoffs in held_
  bool release_deferred_ = false;      // defer_release: first_piece_waited launches nothing
  int64_t invocations_[3] = {0, 0, 0};
};

}  // namespace hp::cp
