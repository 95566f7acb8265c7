// Transports that never touch the network: a group of one rank, and the recording fake group.
#include <algorithm>

#include <ATen/ATen.h>

#include "hp/comm/transport.h"
#include "hp/common/check.h"

namespace hp::comm {
namespace {

// A fake group counts what a real one would hand its backend, so schedules and counters read
// the same as on real ranks; a group of one sends nothing.
class DonePending final : public PendingOp {
 public:
  explicit DonePending(int64_t bytes_sent) { set_bytes_sent(bytes_sent); }
  void wait() override {}
  bool is_completed() override { return true; }
};

int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

class LocalTransport final : public Transport {
 public:
  LocalTransport(int size, bool fake) : size_(size), fake_(fake) {}

  std::string backend_name() const override { return fake_ ? "fake" : "self"; }
  bool has_native_reduce_scatter() const override { return true; }
  bool reduces_dtype(at::ScalarType) const override { return true; }
  bool moves_dtype(at::ScalarType) const override { return true; }

  std::unique_ptr<PendingOp> all_gather(at::Tensor out, at::Tensor in) override {
    for (int i = 0; i < size_; ++i)
      out[i].copy_(in);
    return done((size_ - 1) * nbytes(in));
  }
  std::unique_ptr<PendingOp> all_to_all(at::Tensor out, at::Tensor in) override {
    out.copy_(in);
    return done(nbytes(in) - nbytes(in[0]));
  }
  std::unique_ptr<PendingOp> all_to_all_v(at::Tensor out, at::Tensor in,
                                          std::vector<int64_t> out_rows,
                                          std::vector<int64_t> in_rows) override {
    // A group of one rank: the rows stay. The fake keeps slot 0's rows and zeroes the rest.
    out.zero_();
    const int64_t keep = std::min(in_rows.at(0), out_rows.at(0));
    if (keep > 0) out.narrow(0, 0, keep).copy_(in.narrow(0, 0, keep));
    const int64_t row = in.size(0) > 0 ? nbytes(in) / in.size(0) : 0;
    return done((in.size(0) - in_rows[0]) * row);
  }
  std::unique_ptr<PendingOp> all_reduce(at::Tensor inout, ReduceOp) override {
    return done(size_ > 1 ? nbytes(inout) : 0);
  }
  std::unique_ptr<PendingOp> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp) override {
    out.copy_(in[0]);
    return done(nbytes(in) - nbytes(in[0]));
  }
  std::unique_ptr<PendingOp> send(at::Tensor t, int dst, int) override {
    HP_CHECK(fake_, "send to rank ", dst, " in a group of one rank; a peer must be another rank");
    return done(nbytes(t));
  }
  std::unique_ptr<PendingOp> recv(at::Tensor t, int src, int) override {
    HP_CHECK(fake_, "recv from rank ", src, " in a group of one rank; a peer must be another rank");
    t.zero_();
    return done(0);
  }
  std::unique_ptr<PendingOp> barrier() override { return done(0); }

 private:
  static std::unique_ptr<PendingOp> done(int64_t sent) {
    return std::make_unique<DonePending>(sent);
  }
  int size_;
  bool fake_;
};

}  // namespace

std::unique_ptr<Transport> make_self_transport() {
  return std::make_unique<LocalTransport>(1, /*fake=*/false);
}

std::unique_ptr<Transport> make_fake_transport(int size) {
  return std::make_unique<LocalTransport>(size, /*fake=*/true);
}

}  // namespace hp::comm
