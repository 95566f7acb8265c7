// hyperparallel._C.Group: a torch.distributed ProcessGroup used directly (its C++ object, via
// the pybind11 type torch registered), and sequence sharding over it.
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "bindings.h"
#include "hp/comm/autograd_collectives.h"
#include "hp/comm/transport.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"

namespace py = pybind11;

namespace hp::python {

std::shared_ptr<const cp::CPTopology> TorchGroup::topology(const cp::ContextParallelConfig& c) {
  const int64_t u = cp::ulysses_degree_of(c, group_->size());
  auto it = topologies_.find(u);
  if (it != topologies_.end()) return it->second;
  auto t = cp::CPTopology::from_group(group_, c);
  topologies_[u] = t;
  return t;
}

namespace {

std::shared_ptr<TorchGroup> wrap(const py::object& process_group, const std::vector<int>& ranks,
                                 int world_rank, const std::string& name, double timeout_s) {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  } catch (const py::cast_error&) {
    HP_CHECK(false, "group: expected a torch.distributed ProcessGroup, got ",
             std::string(py::str(py::type::of(process_group).attr("__name__"))),
             "; pass a group from torch.distributed.new_group or None for the default group");
  }
  HP_CHECK(pg->getSize() == static_cast<int>(ranks.size()), "group: the process group has ",
           pg->getSize(), " ranks but its rank list has ", ranks.size());
  HP_CHECK(
      pg->getRank() >= 0 && pg->getRank() < pg->getSize() && ranks[pg->getRank()] == world_rank,
      "group: this process (world rank ", world_rank, ") is not rank ", pg->getRank(),
      " of the rank list; pass the group's own ranks in group-rank order");
  HP_CHECK(timeout_s > 0, "group: timeout ", timeout_s, " s must be positive");
  auto context = std::make_shared<comm::CommContext>();
  context->world_rank = world_rank;
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  auto group = std::make_shared<comm::Group>(
      name, ranks, world_rank, comm::make_process_group_transport(pg), std::move(context), timeout);
  return std::make_shared<TorchGroup>(std::move(group));
}

at::Tensor unshard(const at::Tensor& x, int64_t dim, TorchGroup& g, bool load_balance) {
  HP_CHECK(x.defined(), "unshard_sequence: x is not a tensor");
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  HP_CHECK(d >= 0 && d < x.dim(), "unshard_sequence: dim ", dim, " is out of range for a ", x.dim(),
           "-d tensor");
  const int64_t p = g.group()->size();
  if (p == 1) return x;
  auto full = comm::all_gather_autograd(x, d, g.group());
  return cp::unshard_sequence(full.chunk(p, d), d, load_balance);
}

at::Tensor shard(const at::Tensor& x, int64_t dim, TorchGroup& g, bool load_balance) {
  HP_CHECK(x.defined(), "shard_sequence: x is not a tensor");
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  HP_CHECK(d >= 0 && d < x.dim(), "shard_sequence: dim ", dim, " is out of range for a ", x.dim(),
           "-d tensor");
  return cp::shard_sequence(x, d, g.group()->rank(), g.group()->size(), load_balance);
}

}  // namespace

void bind_group(py::module_& m) {
  py::class_<TorchGroup, std::shared_ptr<TorchGroup>>(
      m, "Group", "A torch.distributed process group as a hyperparallel group (no rendezvous)")
      .def(py::init(&wrap), py::arg("process_group"), py::arg("ranks"), py::arg("world_rank"),
           py::arg("name") = "cp", py::arg("timeout_s") = 1800.0)
      .def_property_readonly("rank", [](const TorchGroup& g) { return g.group()->rank(); })
      .def_property_readonly("size", [](const TorchGroup& g) { return g.group()->size(); })
      .def_property_readonly(
          "backend", [](const TorchGroup& g) { return g.group()->transport().backend_name(); })
      .def("describe", [](const TorchGroup& g) { return g.group()->describe(); })
      .def(
          "bytes_sent",
          [](const TorchGroup& g) { return g.group()->context().counters.total_bytes(); },
          "Bytes this process handed the transport for other ranks over this group (and the CP "
          "sub-groups built on it) since the last reset")
      .def("reset_counters", [](TorchGroup& g) { g.group()->context().counters.reset(); });
  m.def("shard_sequence", &shard, py::arg("x"), py::arg("dim"), py::arg("group"),
        py::arg("load_balance") = false);
  m.def("unshard_sequence", &unshard, py::arg("x"), py::arg("dim"), py::arg("group"),
        py::arg("load_balance") = false, py::call_guard<py::gil_scoped_release>());
}

}  // namespace hp::python
