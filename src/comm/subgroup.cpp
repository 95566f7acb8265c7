// Sub-group collectives as point-to-point legs on the parent's transport (see subgroup.h).
#include "hp/comm/subgroup.h"

#include <atomic>
#include <functional>
#include <mutex>
#include <set>

#include <ATen/ATen.h>

#include "hp/common/check.h"

namespace hp::comm {
namespace {

// Tag layout: [kBase, kBase + kSlots * kSlotSpan) = [2^29, 2^30), below the parent's all-gather
// tags (from 2^30) and far above its point-to-point sequence. A slot per sub-group of the parent
// (its creation index); inside a slot the lower half numbers the sub-group's own send/recv tags,
// the upper half its collectives (each half wraps after 2^18 calls, long after the first
// completed).
constexpr int kBase = 1 << 29;
constexpr int kSlots = 1 << 10;
constexpr int kSlotSpan = 1 << 19;
constexpr int kHalf = kSlotSpan / 2;

// The legs of one collective; `finish` (optional) runs once, after every leg is done and
// before wait() returns or is_completed() first reports true.
class LegsPending final : public PendingOp {
 public:
  LegsPending(std::vector<std::unique_ptr<PendingOp>> legs, std::function<void()> finish)
      : legs_(std::move(legs)), finish_(std::move(finish)) {
    int64_t sent = 0;
    for (auto& l : legs_)
      sent += l->bytes_sent();
    set_bytes_sent(sent);
  }
  void wait() override {
    std::exception_ptr first;
    for (auto& l : legs_) {
      try {
        l->wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    run_finish();
  }
  bool is_completed() override {
    for (auto& l : legs_) {
      if (!l->is_completed()) return false;
    }
    run_finish();
    return true;
  }
  int64_t completed_at_us() const override {
    int64_t last = -1;
    for (const auto& l : legs_) {
      const int64_t t = l->completed_at_us();
      if (t < 0) return -1;
      last = std::max(last, t);
    }
    return last;
  }

 private:
  void run_finish() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finish_) {
      auto f = std::move(finish_);
      finish_ = nullptr;
      f();
    }
  }
  std::vector<std::unique_ptr<PendingOp>> legs_;
  std::function<void()> finish_;
  std::mutex mu_;
};

class SubgroupTransport final : public Transport {
 public:
  SubgroupTransport(GroupPtr parent, std::vector<int> members, int me, int slot)
      : parent_(std::move(parent)), members_(std::move(members)), me_(me), slot_(slot) {}

  std::string backend_name() const override { return parent().backend_name(); }
  bool supports(OpKind op) const override { return parent().supports(op); }
  bool reduces_dtype(at::ScalarType t) const override { return parent().reduces_dtype(t); }
  bool moves_dtype(at::ScalarType t) const override { return parent().moves_dtype(t); }

  std::unique_ptr<PendingOp> all_gather(at::Tensor out, at::Tensor in) override {
    const int tag = next_collective_tag();
    std::vector<std::unique_ptr<PendingOp>> legs;
    const int p = size();
    for (int k = 1; k < p; ++k) {
      const int to = (me_ + k) % p, from = (me_ - k + p) % p;
      legs.push_back(parent().send(in, members_[to], tag));
      legs.push_back(parent().recv(out[from], members_[from], tag));
    }
    out[me_].copy_(in);
    return std::make_unique<LegsPending>(std::move(legs), nullptr);
  }

  std::unique_ptr<PendingOp> all_to_all(at::Tensor out, at::Tensor in) override {
    const int tag = next_collective_tag();
    std::vector<std::unique_ptr<PendingOp>> legs;
    const int p = size();
    for (int k = 1; k < p; ++k) {
      const int to = (me_ + k) % p, from = (me_ - k + p) % p;
      legs.push_back(parent().send(in[to].contiguous(), members_[to], tag));
      legs.push_back(parent().recv(out[from], members_[from], tag));
    }
    out[me_].copy_(in[me_]);
    return std::make_unique<LegsPending>(std::move(legs), nullptr);
  }

  std::unique_ptr<PendingOp> all_to_all_v(at::Tensor out, at::Tensor in,
                                          std::vector<int64_t> out_rows,
                                          std::vector<int64_t> in_rows) override {
    const int tag = next_collective_tag();
    const int p = size();
    auto starts = [](const std::vector<int64_t>& rows) {
      std::vector<int64_t> s(rows.size() + 1, 0);
      for (size_t i = 0; i < rows.size(); ++i)
        s[i + 1] = s[i] + rows[i];
      return s;
    };
    const auto in_at = starts(in_rows), out_at = starts(out_rows);
    std::vector<std::unique_ptr<PendingOp>> legs;
    for (int k = 1; k < p; ++k) {
      const int to = (me_ + k) % p, from = (me_ - k + p) % p;
      if (in_rows[to] > 0)
        legs.push_back(parent().send(in.narrow(0, in_at[to], in_rows[to]), members_[to], tag));
      if (out_rows[from] > 0)
        legs.push_back(
            parent().recv(out.narrow(0, out_at[from], out_rows[from]), members_[from], tag));
    }
    if (in_rows[me_] > 0)
      out.narrow(0, out_at[me_], out_rows[me_]).copy_(in.narrow(0, in_at[me_], in_rows[me_]));
    return std::make_unique<LegsPending>(std::move(legs), nullptr);
  }

  std::unique_ptr<PendingOp> all_reduce(at::Tensor inout, ReduceOp op) override {
    std::vector<int64_t> shape{size()};
    for (auto d : inout.sizes())
      shape.push_back(d);
    auto gathered = at::empty(shape, inout.options());
    auto gather = all_gather(gathered, inout);
    std::vector<std::unique_ptr<PendingOp>> legs;
    legs.push_back(std::move(gather));
    auto finish = [inout, gathered, op]() mutable {
      switch (op) {
        case ReduceOp::kSum:
          at::sum_out(inout, gathered, {0});
          break;
        case ReduceOp::kMax:
          inout.copy_(std::get<0>(gathered.max(0)));
          break;
        case ReduceOp::kMin:
          inout.copy_(std::get<0>(gathered.min(0)));
          break;
        case ReduceOp::kAvg:
          HP_INTERNAL_ASSERT(false, "kAvg must be lowered to kSum before the transport");
      }
    };
    return std::make_unique<LegsPending>(std::move(legs), finish);
  }

  std::unique_ptr<PendingOp> send(at::Tensor t, int dst, int tag) override {
    return parent().send(std::move(t), members_.at(dst), p2p_tag(tag));
  }
  std::unique_ptr<PendingOp> recv(at::Tensor t, int src, int tag) override {
    return parent().recv(std::move(t), members_.at(src), p2p_tag(tag));
  }
  std::unique_ptr<PendingOp> barrier() override {
    auto one = at::zeros({1}, at::kByte);
    auto all = at::empty({size(), 1}, at::kByte);
    return all_gather(all, one);
  }

 private:
  Transport& parent() const { return parent_->transport(); }
  int size() const { return static_cast<int>(members_.size()); }
  int p2p_tag(int tag) const { return kBase + slot_ * kSlotSpan + tag % kHalf; }
  int next_collective_tag() {
    return kBase + slot_ * kSlotSpan + kHalf + static_cast<int>(seq_++ % kHalf);
  }

  GroupPtr parent_;
  std::vector<int> members_;  // parent ranks, in sub-group rank order
  int me_;                    // this rank in the sub-group
  int slot_;
  std::atomic<int64_t> seq_{0};
};

}  // namespace

GroupPtr make_subgroup(const GroupPtr& parent, const std::vector<int>& parent_ranks,
                       const std::string& name) {
  HP_CHECK(parent != nullptr, "make_subgroup '", name, "': the parent group is null");
  HP_CHECK(!parent_ranks.empty(), "make_subgroup '", name, "': the member list is empty");
  std::set<int> seen;
  for (int r : parent_ranks) {
    HP_CHECK(r >= 0 && r < parent->size(), "make_subgroup '", name, "': member ", r,
             " is not a rank of ", parent->describe());
    HP_CHECK(seen.insert(r).second, "make_subgroup '", name, "': member ", r, " is listed twice");
  }
  HP_CHECK(parent->transport().backend_name() != "nccl", "make_subgroup '", name,
           "': ", parent->describe(),
           " is an nccl group, whose point-to-point calls are not told apart by tag; make the "
           "sub-group with World::new_group (or torch.distributed.new_group) instead");
  // Every rank of the parent advances the index, members or not: the same sub-group gets the
  // same slot everywhere.
  const int index = parent->next_subgroup_index();
  HP_CHECK(index < kSlots, "make_subgroup '", name, "': ", parent->describe(), " already has ",
           kSlots, " sub-groups (the tag range holds no more); reuse the ones made");
  auto it = std::find(parent_ranks.begin(), parent_ranks.end(), parent->rank());
  if (it == parent_ranks.end()) return nullptr;
  const int me = static_cast<int>(it - parent_ranks.begin());
  std::vector<int> world_ranks;
  for (int r : parent_ranks)
    world_ranks.push_back(parent->world_ranks()[r]);
  std::unique_ptr<Transport> transport;
  if (parent_ranks.size() == 1) {
    transport = make_self_transport();
  } else {
    transport = std::make_unique<SubgroupTransport>(parent, parent_ranks, me, index);
  }
  return std::make_shared<Group>(name, world_ranks, parent->world_rank(), std::move(transport),
                                 parent->context_ptr(), parent->timeout());
}

}  // namespace hp::comm
