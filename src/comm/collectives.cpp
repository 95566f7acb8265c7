// Collectives: argument checks, re-layout to the transport's [P, chunk] form, one launch path
// (accounting from what the transport handed its backend, launch errors), and the continuation
// that lays the result back out.
//
//   all_gather(t[.., s_d, ..], d)        in  t (contiguous)        out [P, *t.shape]
//                                        -> movedim(0, d) + flatten  -> [.., P*s_d, ..]
//   all_to_all(t, split s, concat c)     in  t.unflatten(s,{P,n/P}).movedim(s,0)  [P, chunk]
//                                        out [P, chunk] (out[i] from rank i)
//                                        -> movedim(0, c) + flatten  -> c grows by P
//   reduce_scatter(t, d)                 in  [P, chunk] as above; native RS, or all_to_all and
//                                        a local reduction over dim 0  -> d shrinks by P
#include "hp/comm/collectives.h"

#include <functional>

#include <ATen/ATen.h>

#include "comm_error.h"
#include "hp/comm/traffic.h"
#include "hp/common/check.h"
#include "hp/common/shape.h"
#include "hp/common/trace.h"

namespace hp::comm {
namespace {

void check_defined(OpKind op, Group& g, const at::Tensor& t) {
  HP_CHECK(t.defined(), op_name(op), " on group '", g.name(),
           "': the input tensor is undefined; pass a tensor");
}

int64_t check_dim(OpKind op, Group& g, const at::Tensor& t, int64_t dim, const char* what) {
  const int64_t nd = t.dim();
  HP_CHECK(nd >= 1, op_name(op), " on group '", g.name(), "': ", what,
           " needs a tensor with at least one dim, got a 0-d tensor");
  HP_CHECK(dim >= -nd && dim < nd, op_name(op), " on group '", g.name(), "': ", what, "=", dim,
           " is out of range for a ", nd, "-d tensor of shape ", common::shape_str(t.sizes()),
           " (valid: ", -nd, "..", nd - 1, ")");
  return dim < 0 ? dim + nd : dim;
}

void check_divisible(OpKind op, Group& g, const at::Tensor& t, int64_t dim, const char* what) {
  const int64_t n = t.size(dim);
  HP_CHECK(n % g.size() == 0, op_name(op), " on group '", g.name(), "': ", what, "=", dim,
           " of shape ", common::shape_str(t.sizes()), " has size ", n,
           ", which is not divisible by the group size ", g.size(), "; pad that dim to a ",
           "multiple of ", g.size(), " or use a group whose size divides ", n);
}

// Every rank exchanges (dtype, shape) and checks they agree; an early, clear error instead of
// garbage or a hang. Only when WorldOptions::verify_shapes is on; not counted as traffic.
void verify_same_shapes(OpKind op, Group& g, const at::Tensor& t) {
  if (!g.context().verify_shapes || g.size() == 1) return;
  constexpr int64_t kMaxDims = 12;
  HP_CHECK(t.dim() <= kMaxDims, op_name(op), ": verify_shapes supports up to ", kMaxDims,
           " dims, got ", t.dim());
  auto desc = at::full({kMaxDims + 2}, -1, at::kLong);  // filled on the CPU, sent from t's device
  auto acc = desc.accessor<int64_t, 1>();
  acc[0] = static_cast<int64_t>(t.scalar_type());
  acc[1] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i)
    acc[2 + i] = t.size(i);
  auto wire_desc = desc.to(t.device());
  auto all = at::empty({g.size(), kMaxDims + 2}, wire_desc.options());
  try {
    // Starting can fail too: a point-to-point leg's send runs on this thread and meets a peer
    // that already left.
    g.transport().all_gather(all, wire_desc)->wait();
  } catch (const std::exception& e) {
    detail::throw_comm_failure(op, g, detail::backend_message(e), "verifying shapes");
  }
  all = all.cpu();
  if (at::equal(all, desc.unsqueeze(0).expand_as(all))) return;
  std::string listing;
  for (int r = 0; r < g.size(); ++r) {
    auto row_t = all[r];
    auto row = row_t.accessor<int64_t, 1>();
    std::vector<int64_t> dims;
    for (int64_t i = 0; i < row[1]; ++i)
      dims.push_back(row[2 + i]);
    listing += common::str_cat(r ? ", " : "", "rank ", r, " ", common::shape_str(dims), " ",
                               c10::toString(static_cast<at::ScalarType>(row[0])));
  }
  HP_CHECK(false, op_name(op), " on group '", g.name(), "': ranks disagree on the input (", listing,
           "); every rank must pass the same shape and dtype");
}

// The counters get what the transport handed its backend for other ranks (PendingOp::
// bytes_sent) and, beside it, the formula for the op (theory_bytes_per_rank); the recorder gets
// the call. Barriers are not traffic.
void account(OpKind op, Group& g, const at::Tensor& t, int64_t bytes_sent, int64_t formula,
             int peer) {
  if (op == OpKind::kBarrier) return;
  auto& ctx = g.context();
  ctx.counters.add(op, g.name(), bytes_sent, formula);
  if (ctx.recorder) {
    ctx.recorder->record(
        {op, g.name(), {t.sizes().vec()}, c10::toString(t.scalar_type()), bytes_sent, peer});
  }
}

int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// Same bytes, a dtype the transport can move (bit-exact). Contiguous.
at::Tensor to_wire(Transport& tr, const at::Tensor& t) {
  auto c = t.contiguous();
  if (tr.moves_dtype(c.scalar_type())) return c;
  switch (c.element_size()) {
    case 1:
      return c.view(at::kByte);
    case 2:
      return c.view(at::kHalf);  // bytes only: Gloo moves half, not int16
    case 4:
      return c.view(at::kInt);
    case 8:
      return c.view(at::kLong);
    default:
      break;
  }
  HP_CHECK(false, "dtype ", c10::toString(c.scalar_type()), " cannot be sent by backend '",
           tr.backend_name(), "'");
}

at::Tensor from_wire(const at::Tensor& w, at::ScalarType dtype) {
  return w.scalar_type() == dtype ? w : w.view(dtype);
}

// [P, chunk] with chunk j = t.narrow(dim, j*n/P, n/P).
at::Tensor split_major(const at::Tensor& t, int64_t dim, int64_t p) {
  return t.unflatten(dim, {p, t.size(dim) / p}).movedim(dim, 0).contiguous();
}

// [P, chunk] -> chunks concatenated along `dim` in rank order.
at::Tensor concat_major(const at::Tensor& out, int64_t dim) {
  if (dim == 0) return out.flatten(0, 1);
  return out.movedim(0, dim).flatten(dim, dim + 1).contiguous();
}

ReduceOp wire_op(ReduceOp op) {
  return op == ReduceOp::kAvg ? ReduceOp::kSum : op;
}

at::Tensor reduce_local(const at::Tensor& stacked, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return stacked.sum(0);
    case ReduceOp::kMax:
      return std::get<0>(stacked.max(0));
    case ReduceOp::kMin:
      return std::get<0>(stacked.min(0));
  }
  return {};
}

at::Tensor finish_avg(at::Tensor t, ReduceOp op, int64_t p) {
  if (op != ReduceOp::kAvg) return t;
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/true)) return t.div_(p, "floor");
  return t.div_(p);
}

// Starts one transport call, accounts what it handed the backend, and wraps it in a handle that
// owns `buffers` until completion. Every collective launches through here, so a backend error
// while launching always becomes the same CommError naming op, group and rank.
CommHandle launch(OpKind op, Group& g, const at::Tensor& input, int64_t formula, int peer,
                  std::vector<at::Tensor> buffers,
                  const std::function<std::unique_ptr<PendingOp>()>& start,
                  CommHandle::Continuation then) {
  std::unique_ptr<PendingOp> pending;
  g.context().ops_launched.fetch_add(1, std::memory_order_relaxed);
  try {
    pending = start();
  } catch (const std::exception& e) {
    detail::throw_comm_failure(op, g, detail::backend_message(e), "launching");
  }
  const int64_t sent = pending->bytes_sent();
  account(op, g, input, sent, formula, peer);
  return CommHandle(g, op, sent, std::move(pending), std::move(buffers), std::move(then));
}

int64_t formula(OpKind op, Group& g, const at::Tensor& t) {
  return theory_bytes_per_rank(op, nbytes(t), g.size());
}

}  // namespace

CommHandle all_gather_async(Group& g, const at::Tensor& t, int64_t dim) {
  constexpr OpKind kOp = OpKind::kAllGather;
  check_defined(kOp, g, t);
  const int64_t d = check_dim(kOp, g, t, dim, "dim");
  verify_same_shapes(kOp, g, t);
  auto in = to_wire(g.transport(), t);
  auto shape = in.sizes().vec();
  shape.insert(shape.begin(), g.size());
  auto out = at::empty(shape, in.options());
  const auto dtype = t.scalar_type();
  return launch(
      kOp, g, t, formula(kOp, g, t), -1, {in, out},
      [&] { return g.transport().all_gather(out, in); },
      [out, d, dtype] { return concat_major(from_wire(out, dtype), d); });
}

CommHandle reduce_scatter_async(Group& g, const at::Tensor& t, int64_t dim, ReduceOp op) {
  constexpr OpKind kOp = OpKind::kReduceScatter;
  check_defined(kOp, g, t);
  const int64_t d = check_dim(kOp, g, t, dim, "dim");
  check_divisible(kOp, g, t, d, "dim");
  verify_same_shapes(kOp, g, t);
  const int64_t p = g.size();
  const auto dtype = t.scalar_type();
  auto& tr = g.transport();
  if (tr.has_native_reduce_scatter()) {
    const bool upcast = !tr.reduces_dtype(dtype);
    auto in = split_major(upcast ? t.to(at::kFloat) : t, d, p);
    auto out = at::empty(in.sizes().slice(1), in.options());
    return launch(
        kOp, g, t, formula(kOp, g, t), -1, {in, out},
        [&] { return tr.reduce_scatter(out, in, wire_op(op)); },
        [out, op, p, dtype] { return finish_avg(out, op, p).to(dtype); });
  }
  // One all-to-all: chunk j of every rank lands on rank j, which reduces the P chunks locally.
  auto in = to_wire(tr, split_major(t, d, p));
  auto out = at::empty_like(in);
  return launch(
      kOp, g, t, formula(kOp, g, t), -1, {in, out}, [&] { return tr.all_to_all(out, in); },
      [out, op, p, dtype] {
        auto stacked = from_wire(out, dtype);
        return finish_avg(reduce_local(stacked, op), op, p);  // chunk r, in t's dim order
      });
}

CommHandle all_to_all_async(Group& g, const at::Tensor& t, int64_t split_dim, int64_t concat_dim) {
  constexpr OpKind kOp = OpKind::kAllToAll;
  check_defined(kOp, g, t);
  const int64_t s = check_dim(kOp, g, t, split_dim, "split_dim");
  const int64_t c = check_dim(kOp, g, t, concat_dim, "concat_dim");
  check_divisible(kOp, g, t, s, "split_dim");
  verify_same_shapes(kOp, g, t);
  auto in = to_wire(g.transport(), split_major(t, s, g.size()));
  auto out = at::empty_like(in);
  const auto dtype = t.scalar_type();
  return launch(
      kOp, g, t, formula(kOp, g, t), -1, {in, out},
      [&] { return g.transport().all_to_all(out, in); },
      [out, c, dtype] { return concat_major(from_wire(out, dtype), c); });
}

CommHandle all_to_all_v_async(Group& g, const at::Tensor& t, const std::vector<int64_t>& send_rows,
                              const std::vector<int64_t>& recv_rows) {
  constexpr OpKind kOp = OpKind::kAllToAll;
  check_defined(kOp, g, t);
  HP_CHECK(t.dim() >= 1, "all_to_all_v on group '", g.name(),
           "': needs a tensor with at least one dim (rows), got a 0-d tensor");
  const size_t p = static_cast<size_t>(g.size());
  HP_CHECK(send_rows.size() == p && recv_rows.size() == p, "all_to_all_v on group '", g.name(),
           "': send_rows has ", send_rows.size(), " and recv_rows ", recv_rows.size(),
           " entries; both need one per rank (", p, ")");
  int64_t sent_rows = 0, received_rows = 0, to_others = 0;
  for (size_t j = 0; j < p; ++j) {
    HP_CHECK(send_rows[j] >= 0 && recv_rows[j] >= 0, "all_to_all_v on group '", g.name(),
             "': row counts must be >= 0, got send_rows[", j, "]=", send_rows[j], " recv_rows[", j,
             "]=", recv_rows[j]);
    sent_rows += send_rows[j];
    received_rows += recv_rows[j];
    if (static_cast<int>(j) != g.rank()) to_others += send_rows[j];
  }
  HP_CHECK(sent_rows == t.size(0), "all_to_all_v on group '", g.name(), "': send_rows sum to ",
           sent_rows, " but the input has ", t.size(0), " rows (shape ",
           common::shape_str(t.sizes()), "); the counts must cover every row once");
  auto in = to_wire(g.transport(), t.contiguous());
  auto shape = in.sizes().vec();
  shape[0] = received_rows;
  auto out = at::empty(shape, in.options());
  const int64_t row_bytes = t.size(0) > 0 ? nbytes(t) / t.size(0) : 0;
  const auto dtype = t.scalar_type();
  return launch(
      kOp, g, t, to_others * row_bytes, -1, {in, out},
      [&] { return g.transport().all_to_all_v(out, in, recv_rows, send_rows); },
      [out, dtype] { return from_wire(out, dtype); });
}

at::Tensor all_to_all_v(Group& g, const at::Tensor& t, const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows) {
  return all_to_all_v_async(g, t, send_rows, recv_rows).wait();
}

std::vector<int64_t> all_to_all_counts(Group& g, const std::vector<int64_t>& send) {
  HP_CHECK(send.size() == static_cast<size_t>(g.size()), "all_to_all_counts on group '", g.name(),
           "': ", send.size(), " counts for a group of ", g.size(), "; pass one per rank");
  auto t = at::tensor(send, at::kLong);
  auto got = all_to_all(g, t, 0, 0).contiguous();
  return std::vector<int64_t>(got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + got.numel());
}

CommHandle all_reduce_async(Group& g, const at::Tensor& t, ReduceOp op) {
  constexpr OpKind kOp = OpKind::kAllReduce;
  check_defined(kOp, g, t);
  verify_same_shapes(kOp, g, t);
  const auto dtype = t.scalar_type();
  const bool upcast = !g.transport().reduces_dtype(dtype);
  auto buf = upcast ? t.to(at::kFloat).contiguous() : t.contiguous().clone();
  const int64_t p = g.size();
  return launch(
      kOp, g, t, formula(kOp, g, t), -1, {buf},
      [&] { return g.transport().all_reduce(buf, wire_op(op)); },
      [buf, op, p, dtype] { return finish_avg(buf, op, p).to(dtype); });
}

namespace {

void check_peer(OpKind op, Group& g, int peer, const char* what) {
  HP_CHECK(peer >= 0 && peer < g.size() && peer != g.rank(), op_name(op), " on group '", g.name(),
           "': ", what, "=", peer, " must be another rank of the group (0..", g.size() - 1,
           ", not ", g.rank(), ")");
}

}  // namespace

CommHandle send_async(Group& g, const at::Tensor& t, int dst) {
  constexpr OpKind kOp = OpKind::kSend;
  check_defined(kOp, g, t);
  check_peer(kOp, g, dst, "dst");
  auto buf = to_wire(g.transport(), t);
  const int tag = g.next_p2p_tag(dst, /*sending=*/true);
  return launch(
      kOp, g, t, formula(kOp, g, t), dst, {buf}, [&] { return g.transport().send(buf, dst, tag); },
      [] { return at::Tensor(); });
}

CommHandle recv_async(Group& g, at::IntArrayRef shape, const at::TensorOptions& options, int src) {
  constexpr OpKind kOp = OpKind::kRecv;
  check_peer(kOp, g, src, "src");
  auto result = at::empty(shape, options);
  auto buf = to_wire(g.transport(), result);
  const int tag = g.next_p2p_tag(src, /*sending=*/false);
  return launch(
      kOp, g, result, 0, src, {buf}, [&] { return g.transport().recv(buf, src, tag); },
      [result] { return result; });
}

at::Tensor exchange(Group& g, const at::Tensor& t, int peer) {
  check_defined(OpKind::kSend, g, t);
  if (peer == g.rank()) return t.clone();
  // Lower rank sends first so the tag sequences pair up; both are in flight together.
  CommHandle s, r;
  if (g.rank() < peer) {
    s = send_async(g, t, peer);
    r = recv_async(g, t.sizes(), t.options(), peer);
  } else {
    r = recv_async(g, t.sizes(), t.options(), peer);
    s = send_async(g, t, peer);
  }
  s.wait();
  return r.wait();
}

at::Tensor shift(Group& g, const at::Tensor& t, int offset) {
  check_defined(OpKind::kSend, g, t);
  const int p = g.size();
  const int to = ((g.rank() + offset) % p + p) % p, from = ((g.rank() - offset) % p + p) % p;
  if (to == g.rank()) return t.clone();
  // Both legs in flight together; tags pair per (peer, direction), so the order is free.
  auto r = recv_async(g, t.sizes(), t.options(), from);
  auto s = send_async(g, t, to);
  s.wait();
  return r.wait();
}

void barrier(Group& g) {
  launch(
      OpKind::kBarrier, g, at::Tensor(), 0, -1, {}, [&] { return g.transport().barrier(); },
      nullptr)
      .wait();
}

at::Tensor all_gather(Group& g, const at::Tensor& t, int64_t dim) {
  return all_gather_async(g, t, dim).wait();
}
at::Tensor reduce_scatter(Group& g, const at::Tensor& t, int64_t dim, ReduceOp op) {
  return reduce_scatter_async(g, t, dim, op).wait();
}
at::Tensor all_to_all(Group& g, const at::Tensor& t, int64_t split_dim, int64_t concat_dim) {
  return all_to_all_async(g, t, split_dim, concat_dim).wait();
}
at::Tensor all_reduce(Group& g, const at::Tensor& t, ReduceOp op) {
  return all_reduce_async(g, t, op).wait();
}
void send(Group& g, const at::Tensor& t, int dst) {
  send_async(g, t, dst).wait();
}
at::Tensor recv(Group& g, at::IntArrayRef shape, const at::TensorOptions& options, int src) {
  return recv_async(g, shape, options, src).wait();
}

}  // namespace hp::comm
