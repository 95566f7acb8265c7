// Validate mode (DESIGN section 9): boundary tensors carry a Layout — the mesh plus one
// placement per mesh dim — checked at every module boundary. Production mode runs the same
// kernels without the bookkeeping.
//
//   Placement  Shard(d) (tensor dim d split over the mesh dim), Replicate, Partial (a sum is due)
//   Layout     ((cp, Shard(1)), (tp, Replicate)) — printed as "(cp: Shard(1), tp: Replicate)"
// A BoundaryChecker keeps the Layout of every boundary tensor (keyed by the tensor, not
// copied), checks each module's input against the layout its spec expects — placements and the
// local sizes they imply — and records the module's output layout. A mismatch is an hp::Error
// naming the module, the expected and the actual layout.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hp::plan {

struct Placement {
  enum class Kind { kShard, kReplicate, kPartial } kind = Kind::kReplicate;
  int64_t dim = 0;  // kShard only
  static Placement shard(int64_t d) { return {Kind::kShard, d}; }
  static Placement replicate() { return {Kind::kReplicate, 0}; }
  static Placement partial() { return {Kind::kPartial, 0}; }
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::kShard || dim == o.dim);
  }
  std::string to_string() const;
};

struct Layout {
  std::vector<std::pair<std::string, Placement>> placements;  // mesh dim name -> placement
  bool operator==(const Layout& o) const { return placements == o.placements; }
  std::string to_string() const;
};

enum class Mode { kProduction, kValidate };

class BoundaryChecker {
 public:
  // `mesh_sizes`: mesh dim name -> size; `global_sizes`: tensor dim -> global length to check
  // Shard placements against (e.g. {1: seq_len}); dims not listed are not size-checked.
  BoundaryChecker(std::map<std::string, int64_t> mesh_sizes,
                  std::map<int64_t, int64_t> global_sizes);

  // Registers the layout of a tensor entering the model (e.g. the sharded input ids).
  void set(const at::Tensor& t, const Layout& layout);
  // Checks `t` at `module`'s input against `expected` (throws on mismatch).
  void check_input(const std::string& module, const at::Tensor& t, const Layout& expected) const;
  // Records `t` as `module`'s output with `layout` (after checking its local sizes).
  void set_output(const std::string& module, const at::Tensor& t, const Layout& layout);
  // `copy` (a recomputed block's detached input: the same values) carries `original`'s layout;
  // nothing where the original has none (its own check reports that).
  void carry(const at::Tensor& original, const at::Tensor& copy);
  int64_t checks() const { return checks_; }

 private:
  void check_sizes(const std::string& module, const at::Tensor& t, const Layout& layout) const;
  std::map<std::string, int64_t> mesh_sizes_;
  std::map<int64_t, int64_t> global_sizes_;
  mutable std::mutex mu_;
  std::map<const void*, std::pair<at::Tensor, Layout>> layouts_;  // keeps keys alive
  mutable int64_t checks_ = 0;
};

}  // namespace hp::plan
