// The pieces of the hyperparallel._C extension module (one binding function per file).
//
// Contract with the pure-Python package (python/hyperparallel/__init__.py): it checks argument
// types and keywords and resolves torch.distributed groups (their ranks); everything about
// shapes, layouts and configurations is checked here, by the C++ library, before any
// collective, and crosses as ValueError with the library's message.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "hp/comm/group.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"

namespace hp::python {

// A torch.distributed process group as a hyperparallel group (its C++ object, no second
// rendezvous), with the CP topologies built over it so far.
class TorchGroup {
 public:
  TorchGroup(comm::GroupPtr group) : group_(std::move(group)) {}  // NOLINT
  const comm::GroupPtr& group() const { return group_; }
  // The topology for `config` (normalised): built on first use per Ulysses degree (its
  // sub-groups ride on this group's transport; no communication; every rank builds them in
  // the same order because every rank makes the same calls), the same object afterwards.
  std::shared_ptr<const cp::CPTopology> topology(const cp::ContextParallelConfig& config);

 private:
  comm::GroupPtr group_;
  std::map<int64_t, std::shared_ptr<const cp::CPTopology>> topologies_;  // by Ulysses degree
};

void bind_group(pybind11::module_& m);      // group.cpp: Group, shard/unshard
void bind_attention(pybind11::module_& m);  // attention.cpp: CPAttention, LinearAttentionCP
void bind_plan(pybind11::module_& m);       // plan.cpp: plan()

}  // namespace hp::python
