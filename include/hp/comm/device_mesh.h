// DeviceMesh: an n-D arrangement of the world's ranks with named dims, row-major, last dim
// fastest (standard order: dp_replicate, dp_shard, cp, tp).
//
// Groups are created only by the constructor (one per dim, plus MeshOptions::flattened) and by
// create_group() at apply time, on every rank in the same order, and cached. group() only looks
// up: asking inside a training step for a group that was never created is an error, never a
// silent (and possibly deadlocking) creation.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "hp/comm/group.h"
#include "hp/comm/world.h"

namespace hp::comm {

struct MeshDim {
  std::string name;
  int64_t size = 1;
};

// A partition of the world into groups that no set of dims describes (e.g. expert parallelism:
// blocks of consecutive ranks inside the flattened (dp_shard, cp) group). Ranks whose
// coordinates give the same key form one group, members in world-rank order.
struct MeshPartition {
  std::string name;
  std::function<int64_t(const std::vector<int64_t>& coordinates)> key;
};

struct MeshOptions {
  // Flattened multi-dim groups to create eagerly, e.g. {{"dp_shard", "cp"}}.
  std::vector<std::vector<std::string>> flattened;
  std::vector<MeshPartition> partitions;  // created eagerly too, looked up by name
};

class DeviceMesh {
 public:
  DeviceMesh(World world, std::vector<MeshDim> dims, const MeshOptions& options = {});

  const World& world() const { return world_; }
  const std::vector<MeshDim>& dims() const { return dims_; }
  bool has_dim(const std::string& name) const;
  int64_t size() const;                              // product of all dims
  int64_t size(const std::string& dim) const;        // one dim's size
  int64_t coordinate(const std::string& dim) const;  // this rank's coordinate on `dim`
  std::vector<int64_t> coordinates_of(int world_rank) const;
  int rank_at(const std::vector<int64_t>& coordinates) const;

  // World ranks of the group over `dims` that contains `world_rank` (pure, no communication).
  // Dims are taken in mesh order; ranks are row-major over them.
  std::vector<int> group_ranks(const std::vector<std::string>& dims, int world_rank) const;

  // Collective over the whole world (same order on every rank); idempotent.
  Group& create_group(const std::vector<std::string>& dims);

  // Lookup only: throws if the group was not created.
  Group& group(const std::string& dim) const;
  Group& flattened_group(const std::vector<std::string>& dims) const;
  GroupPtr group_ptr(const std::vector<std::string>& dims) const;

  // This rank's group of the partition `name` (MeshOptions::partitions); lookup only.
  GroupPtr partition_group(const std::string& name) const;

  std::string describe() const;  // "(dp_shard=2, cp=2, tp=1)"

 private:
  std::vector<std::string> canonical(const std::vector<std::string>& dims) const;
  size_t index_of(const std::string& dim) const;

  World world_;
  std::vector<MeshDim> dims_;
  std::map<std::vector<std::string>, GroupPtr> groups_;
  std::map<std::string, GroupPtr> partitions_;
};

}  // namespace hp::comm
