#include "hp/cp/topology.h"

#include <algorithm>
#include <functional>

#include "hp/comm/subgroup.h"
#include "hp/common/check.h"

namespace hp::cp {

namespace {

// The topology of `cp_group` for `config`; `make(members, name)` makes the group of those world
// ranks, called in the same order with the same arguments on every rank of the CP group (members
// get the group, the others null).
using MakeGroup =
    std::function<comm::GroupPtr(const std::vector<int>& world_ranks, const std::string& name)>;

std::shared_ptr<const CPTopology> build_topology(const comm::GroupPtr& cp_group,
                                                 const ContextParallelConfig& config,
                                                 const MakeGroup& make) {
  HP_CHECK(cp_group != nullptr, "CP topology: this rank has no CP group");
  auto t = std::make_shared<CPTopology>();
  t->cp = cp_group;
  t->cp_size = cp_group->size();
  t->cp_rank = cp_group->rank();
  t->ulysses_degree = ulysses_degree_of(config, t->cp_size);
  t->colossal_degree = t->cp_size / t->ulysses_degree;
  t->ulysses_rank = t->cp_rank % t->ulysses_degree;
  t->co_rank = t->cp_rank / t->ulysses_degree;
  const auto& w = cp_group->world_ranks();
  const int64_t u = t->ulysses_degree, c = t->colossal_degree;
  if (u == 1) {
    t->co = cp_group;
    t->ulysses = make({cp_group->world_rank()}, "cp_ulysses");
  } else if (c == 1) {
    t->ulysses = cp_group;
    t->co = make({cp_group->world_rank()}, "cp_co");
  } else {
    // Same calls in the same order on every rank; members create, the others skip.
    for (int64_t i = 0; i < c; ++i) {
      std::vector<int> members(w.begin() + i * u, w.begin() + (i + 1) * u);
      if (auto g = make(members, "cp_ulysses")) t->ulysses = g;
    }
    for (int64_t j = 0; j < u; ++j) {
      std::vector<int> members;
      for (int64_t i = 0; i < c; ++i)
        members.push_back(w[i * u + j]);
      if (auto g = make(members, "cp_co")) t->co = g;
    }
  }
  HP_INTERNAL_ASSERT(t->ulysses && t->co, "hybrid sub-groups missing on world rank ",
                     cp_group->world_rank());
  return t;
}

}  // namespace

std::shared_ptr<const CPTopology> CPTopology::build(const comm::World& world,
                                                    const comm::GroupPtr& cp_group,
                                                    const ContextParallelConfig& config) {
  return build_topology(cp_group, config, [&](const std::vector<int>& ranks, const std::string& n) {
    return world.new_group(ranks, n);
  });
}

std::shared_ptr<const CPTopology> CPTopology::from_group(const comm::GroupPtr& cp_group,
                                                         const ContextParallelConfig& config) {
  HP_CHECK(cp_group != nullptr, "CP topology: this rank has no CP group");
  const auto& w = cp_group->world_ranks();
  return build_topology(cp_group, config, [&](const std::vector<int>& ranks, const std::string& n) {
    std::vector<int> members;  // as ranks of the CP group
    for (int r : ranks)
      members.push_back(static_cast<int>(std::find(w.begin(), w.end(), r) - w.begin()));
    return comm::make_subgroup(cp_group, members, n);
  });
}

std::string CPTopology::id() const {
  std::string ranks;
  for (int r : cp->world_ranks())
    ranks += common::str_cat(ranks.empty() ? "" : ",", r);
  return common::str_cat("cp[", ranks, "]u", ulysses_degree);
}

std::shared_ptr<const CPTopology> CPTopologyCache::get(const comm::World& world,
                                                       const comm::GroupPtr& cp_group,
                                                       const ContextParallelConfig& config) {
  HP_CHECK(cp_group != nullptr, "CP topology: this rank has no CP group");
  const int64_t u = ulysses_degree_of(config, cp_group->size());
  auto key = std::make_tuple(cp_group->world_ranks(), u, config.algorithm.name());
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  auto t = CPTopology::build(world, cp_group, config);
  cache_[key] = t;
  return t;
}

}  // namespace hp::cp
