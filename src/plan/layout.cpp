#include "hp/plan/layout.h"

#include "hp/common/check.h"
#include "hp/common/shape.h"

namespace hp::plan {

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::kShard:
      return common::str_cat("Shard(", dim, ")");
    case Kind::kReplicate:
      return "Replicate";
    case Kind::kPartial:
      return "Partial";
  }
  return "?";
}

std::string Layout::to_string() const {
  std::string out = "(";
  for (size_t i = 0; i < placements.size(); ++i) {
    out +=
        common::str_cat(i ? ", " : "", placements[i].first, ": ", placements[i].second.to_string());
  }
  return out + ")";
}

BoundaryChecker::BoundaryChecker(std::map<std::string, int64_t> mesh_sizes,
                                 std::map<int64_t, int64_t> global_sizes)
    : mesh_sizes_(std::move(mesh_sizes)), global_sizes_(std::move(global_sizes)) {}

void BoundaryChecker::check_sizes(const std::string& module, const at::Tensor& t,
                                  const Layout& layout) const {
  for (const auto& [dim, global] : global_sizes_) {
    if (dim >= t.dim()) continue;
    int64_t parts = 1;
    for (const auto& [mesh_dim, p] : layout.placements) {
      if (p.kind == Placement::Kind::kShard && p.dim == dim) parts *= mesh_sizes_.at(mesh_dim);
    }
    HP_CHECK(t.size(dim) * parts == global, "validate: module '", module, "': a tensor ",
             common::shape_str(t.sizes()), " with layout ", layout.to_string(),
             " implies a global size ", t.size(dim) * parts, " along dim ", dim, ", expected ",
             global);
  }
}

void BoundaryChecker::set(const at::Tensor& t, const Layout& layout) {
  check_sizes("<input>", t, layout);
  std::lock_guard<std::mutex> lock(mu_);
  layouts_[t.unsafeGetTensorImpl()] = {t, layout};
}

void BoundaryChecker::check_input(const std::string& module, const at::Tensor& t,
                                  const Layout& expected) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layouts_.find(t.unsafeGetTensorImpl());
  HP_CHECK(it != layouts_.end(), "validate: module '", module, "' received a tensor ",
           common::shape_str(t.sizes()), " that carries no layout (expected ", expected.to_string(),
           "): it did not come from a checked boundary");
  HP_CHECK(it->second.second == expected, "validate: placement mismatch at module '", module,
           "': expected ", expected.to_string(), ", actual ", it->second.second.to_string());
  ++checks_;
}

void BoundaryChecker::set_output(const std::string& module, const at::Tensor& t,
                                 const Layout& layout) {
  check_sizes(module, t, layout);
  std::lock_guard<std::mutex> lock(mu_);
  layouts_[t.unsafeGetTensorImpl()] = {t, layout};
}

void BoundaryChecker::carry(const at::Tensor& original, const at::Tensor& copy) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layouts_.find(original.unsafeGetTensorImpl());
  if (it == layouts_.end()) return;
  const Layout layout = it->second.second;
  layouts_[copy.unsafeGetTensorImpl()] = {copy, layout};
}

}  // namespace hp::plan
