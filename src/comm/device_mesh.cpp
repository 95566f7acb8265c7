#include "hp/comm/device_mesh.h"

#include <algorithm>
#include <set>

#include "hp/common/check.h"

namespace hp::comm {
namespace {

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i)
    out += (i ? sep : "") + v[i];
  return out;
}

}  // namespace

DeviceMesh::DeviceMesh(World world, std::vector<MeshDim> dims, const MeshOptions& options)
    : world_(std::move(world)), dims_(std::move(dims)) {
  HP_CHECK(!dims_.empty(), "DeviceMesh: no dims given; pass at least one, e.g. {{\"cp\", ",
           world_.size(), "}}");
  std::set<std::string> names;
  int64_t product = 1;
  for (const auto& d : dims_) {
    HP_CHECK(!d.name.empty(), "DeviceMesh: a dim has an empty name");
    HP_CHECK(names.insert(d.name).second, "DeviceMesh: dim '", d.name, "' appears twice");
    HP_CHECK(d.size >= 1, "DeviceMesh: dim '", d.name, "' has size ", d.size,
             "; sizes must be >= 1");
    product *= d.size;
  }
  HP_CHECK(product == world_.size(), "DeviceMesh: dims ", describe(), " multiply to ", product,
           " but the world has ", world_.size(),
           " ranks; choose sizes whose product is the world size");
  for (const auto& d : dims_)
    create_group({d.name});
  for (const auto& f : options.flattened)
    create_group(f);
  for (const auto& part : options.partitions) {
    HP_CHECK(part.key && !part.name.empty() && partitions_.count(part.name) == 0,
             "DeviceMesh: partition '", part.name, "' needs a unique name and a key");
    // Every rank walks the keys in the order of their first member; members create theirs.
    std::vector<int64_t> keys;
    std::map<int64_t, std::vector<int>> members;
    for (int r = 0; r < world_.size(); ++r) {
      const int64_t k = part.key(coordinates_of(r));
      if (members.count(k) == 0) keys.push_back(k);
      members[k].push_back(r);
    }
    for (const int64_t k : keys) {
      auto created = world_.new_group(members[k], part.name);
      if (created) partitions_[part.name] = created;
    }
  }
}

GroupPtr DeviceMesh::partition_group(const std::string& name) const {
  auto it = partitions_.find(name);
  HP_CHECK(it != partitions_.end(), "DeviceMesh: no partition group '", name,
           "' was created; add it to MeshOptions::partitions");
  return it->second;
}

bool DeviceMesh::has_dim(const std::string& name) const {
  return std::any_of(dims_.begin(), dims_.end(), [&](const MeshDim& d) { return d.name == name; });
}

size_t DeviceMesh::index_of(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].name == dim) return i;
  }
  std::vector<std::string> names;
  for (const auto& d : dims_)
    names.push_back(d.name);
  HP_CHECK(false, "DeviceMesh: no dim named '", dim, "'; the mesh has: ", join(names, ", "));
}

int64_t DeviceMesh::size() const {
  int64_t p = 1;
  for (const auto& d : dims_)
    p *= d.size;
  return p;
}

int64_t DeviceMesh::size(const std::string& dim) const {
  return dims_[index_of(dim)].size;
}

std::vector<int64_t> DeviceMesh::coordinates_of(int world_rank) const {
  HP_CHECK(world_rank >= 0 && world_rank < size(), "DeviceMesh: rank ", world_rank,
           " is outside the mesh [0, ", size(), ")");
  std::vector<int64_t> c(dims_.size());
  int64_t r = world_rank;
  for (size_t i = dims_.size(); i-- > 0;) {
    c[i] = r % dims_[i].size;
    r /= dims_[i].size;
  }
  return c;
}

int64_t DeviceMesh::coordinate(const std::string& dim) const {
  return coordinates_of(world_.rank())[index_of(dim)];
}

int DeviceMesh::rank_at(const std::vector<int64_t>& c) const {
  HP_CHECK(c.size() == dims_.size(), "DeviceMesh::rank_at: got ", c.size(), " coordinates for a ",
           dims_.size(), "-d mesh");
  int64_t r = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    HP_CHECK(c[i] >= 0 && c[i] < dims_[i].size, "DeviceMesh::rank_at: coordinate ", c[i],
             " of dim '", dims_[i].name, "' is outside [0, ", dims_[i].size, ")");
    r = r * dims_[i].size + c[i];
  }
  return static_cast<int>(r);
}

std::vector<std::string> DeviceMesh::canonical(const std::vector<std::string>& dims) const {
  HP_CHECK(!dims.empty(), "DeviceMesh: a group needs at least one dim");
  std::vector<size_t> idx;
  for (const auto& d : dims)
    idx.push_back(index_of(d));
  std::sort(idx.begin(), idx.end());
  HP_CHECK(std::adjacent_find(idx.begin(), idx.end()) == idx.end(),
           "DeviceMesh: a dim is listed twice in {", join(dims, ", "), "}");
  std::vector<std::string> out;
  for (size_t i : idx)
    out.push_back(dims_[i].name);
  return out;
}

std::vector<int> DeviceMesh::group_ranks(const std::vector<std::string>& dims,
                                         int world_rank) const {
  auto names = canonical(dims);
  std::vector<size_t> idx;
  for (const auto& d : names)
    idx.push_back(index_of(d));
  auto base = coordinates_of(world_rank);
  int64_t count = 1;
  for (size_t i : idx)
    count *= dims_[i].size;
  std::vector<int> ranks;
  for (int64_t k = 0; k < count; ++k) {
    auto c = base;
    int64_t rem = k;
    for (size_t j = idx.size(); j-- > 0;) {
      c[idx[j]] = rem % dims_[idx[j]].size;
      rem /= dims_[idx[j]].size;
    }
    ranks.push_back(rank_at(c));
  }
  return ranks;
}

Group& DeviceMesh::create_group(const std::vector<std::string>& dims) {
  auto key = canonical(dims);
  if (auto it = groups_.find(key); it != groups_.end()) return *it->second;
  // Every rank walks all groups of this dim set in the same order; members create theirs.
  std::vector<size_t> other;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (std::find(key.begin(), key.end(), dims_[i].name) == key.end()) other.push_back(i);
  }
  int64_t groups = 1;
  for (size_t i : other)
    groups *= dims_[i].size;
  const std::string name = join(key, "+");
  GroupPtr mine;
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<int64_t> c(dims_.size(), 0);
    int64_t rem = g;
    for (size_t j = other.size(); j-- > 0;) {
      c[other[j]] = rem % dims_[other[j]].size;
      rem /= dims_[other[j]].size;
    }
    auto members = group_ranks(key, rank_at(c));
    auto created = world_.new_group(members, name);
    if (created) mine = created;
  }
  HP_INTERNAL_ASSERT(mine != nullptr, "rank ", world_.rank(), " got no group for ", name);
  groups_[key] = mine;
  return *mine;
}

GroupPtr DeviceMesh::group_ptr(const std::vector<std::string>& dims) const {
  auto key = canonical(dims);
  auto it = groups_.find(key);
  HP_CHECK(it != groups_.end(), "DeviceMesh: the group over {", join(key, ", "),
           "} was not created. Groups are created at mesh construction or apply time, never "
           "inside a step: add it to MeshOptions::flattened or call create_group() up front");
  return it->second;
}

Group& DeviceMesh::flattened_group(const std::vector<std::string>& dims) const {
  return *group_ptr(dims);
}
Group& DeviceMesh::group(const std::string& dim) const {
  return *group_ptr({dim});
}

std::string DeviceMesh::describe() const {
  std::string out = "(";
  for (size_t i = 0; i < dims_.size(); ++i) {
    out += common::str_cat(i ? ", " : "", dims_[i].name, "=", dims_[i].size);
  }
  return out + ")";
}

}  // namespace hp::comm
