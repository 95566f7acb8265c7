// A process group: an ordered set of world ranks with one Transport, a timeout, and the
// CommContext (counters, tracer, recorder) of the World that made it.
//
// Groups are created only by World::new_group / DeviceMesh at construction or apply time, never
// inside a training step. Collectives on a group are free functions in collectives.h.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hp/comm/traffic.h"
#include "hp/comm/transport.h"

namespace hp::comm {

class Group {
 public:
  Group(std::string name, std::vector<int> world_ranks, int world_rank,
        std::unique_ptr<Transport> transport, std::shared_ptr<CommContext> context,
        std::chrono::milliseconds timeout);

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }  // this process's rank inside the group
  int size() const { return static_cast<int>(world_ranks_.size()); }
  int world_rank() const { return world_ranks_[rank_]; }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  Transport& transport() { return *transport_; }
  CommContext& context() { return *context_; }
  const CommContext& context() const { return *context_; }
  std::shared_ptr<CommContext> context_ptr() const { return context_; }

  // "group 'cp' (rank 1 of 2, world rank 3)": used in every error message.
  std::string describe() const;

  // Tag for the next send/recv with `peer` (group rank). Both sides advance their counter in
  // the same order, so matching calls get matching tags.
  int next_p2p_tag(int peer, bool sending);
  // The index of the next sub-group made on this group (comm::make_subgroup): every rank of the
  // group makes its sub-groups in the same order, so the same sub-group gets the same index.
  int next_subgroup_index();

 private:
  std::string name_;
  std::vector<int> world_ranks_;
  int rank_ = 0;
  std::unique_ptr<Transport> transport_;
  std::shared_ptr<CommContext> context_;
  std::chrono::milliseconds timeout_;
  std::mutex tag_mu_;
  std::map<std::pair<int, bool>, int> p2p_seq_;
  int subgroups_made_ = 0;
};

using GroupPtr = std::shared_ptr<Group>;

}  // namespace hp::comm
