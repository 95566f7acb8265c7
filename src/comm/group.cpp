#include "hp/comm/group.h"

#include <algorithm>

#include "hp/common/check.h"

namespace hp::comm {

Group::Group(std::string name, std::vector<int> world_ranks, int world_rank,
             std::unique_ptr<Transport> transport, std::shared_ptr<CommContext> context,
             std::chrono::milliseconds timeout)
    : name_(std::move(name)),
      world_ranks_(std::move(world_ranks)),
      transport_(std::move(transport)),
      context_(std::move(context)),
      timeout_(timeout) {
  auto it = std::find(world_ranks_.begin(), world_ranks_.end(), world_rank);
  HP_INTERNAL_ASSERT(it != world_ranks_.end(), "world rank ", world_rank, " not in group ", name_);
  rank_ = static_cast<int>(it - world_ranks_.begin());
  HP_INTERNAL_ASSERT(transport_ != nullptr && context_ != nullptr);
}

std::string Group::describe() const {
  return common::str_cat("group '", name_, "' (rank ", rank_, " of ", size(), ", world rank ",
                         world_rank(), ")");
}

int Group::next_p2p_tag(int peer, bool sending) {
  std::lock_guard<std::mutex> lock(tag_mu_);
  // Tag = sequence number of this (direction, peer) pair; the peer's opposite direction for
  // this rank advances identically.
  return p2p_seq_[{peer, sending}]++;
}

int Group::next_subgroup_index() {
  std::lock_guard<std::mutex> lock(tag_mu_);
  return subgroups_made_++;
}

}  // namespace hp::comm
