// CP process groups of one attention region, built once at apply time from the 1-D CP group.
//
// hybrid (P = C * U): CP ranks tiled row-major into (cp_co, cp_ulysses): a Ulysses group is U
// consecutive CP ranks, a co group is the ranks U apart (cp=4, U=2: ulysses {0,1},{2,3};
// co {0,2},{1,3}). all_gather uses the CP group as its co group, ulysses as its Ulysses group.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "hp/comm/world.h"
#include "hp/cp/config.h"

namespace hp::cp {

struct CPTopology {
  int64_t cp_size = 1;
  int64_t cp_rank = 0;
  int64_t ulysses_degree = 1;   // U
  int64_t colossal_degree = 1;  // C = P / U
  int64_t ulysses_rank = 0;     // cp_rank % U
  int64_t co_rank = 0;          // cp_rank / U
  comm::GroupPtr cp;            // the 1-D CP group
  comm::GroupPtr ulysses;       // size U (== cp for ulysses, a group of one for all_gather)
  comm::GroupPtr co;            // size C (== cp for all_gather, a group of one for ulysses)

  // Collective over the whole world (every rank calls it, same order). `cp_group` is this
  // rank's CP group; every CP group of the world must have the same size.
  static std::shared_ptr<const CPTopology> build(const comm::World& world,
                                                 const comm::GroupPtr& cp_group,
                                                 const ContextParallelConfig& config);
  // The same topology with no World and no rendezvous: the Ulysses and co groups are
  // sub-groups of `cp_group` carried by its own transport (comm::make_subgroup). Collective over
  // the CP group only. For CP groups made outside hyperparallel (a torch.distributed group).
  static std::shared_ptr<const CPTopology> from_group(const comm::GroupPtr& cp_group,
                                                      const ContextParallelConfig& config);
  std::string id() const;  // distinguishes runtimes built on different topologies
};

// Builds each (CP group, Ulysses degree) topology once and hands out the same one afterwards.
class CPTopologyCache {
 public:
  std::shared_ptr<const CPTopology> get(const comm::World& world, const comm::GroupPtr& cp_group,
                                        const ContextParallelConfig& config);

 private:
  std::map<std::tuple<std::vector<int>, int64_t, std::string>, std::shared_ptr<const CPTopology>>
      cache_;
};

}  // namespace hp::cp
