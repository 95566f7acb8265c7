// A name-keyed registry of immutable objects that have a name() (CP strategies, CP adapters).
// A registry is a value: the built-in ones are immutable; to add an entry, copy one (or start
// empty), add(), and hand it to whoever looks names up. Errors list the valid names.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hp/common/check.h"

namespace hp::common {

template <typename T>
class NamedRegistry {
 public:
  // `what` names an entry in messages: "CP strategy", "CP adapter".
  explicit NamedRegistry(std::string what) : what_(std::move(what)) {}

  // Throws hp::Error on a null entry, an empty name, or a name already registered.
  void add(std::shared_ptr<const T> item) {
    HP_CHECK(item != nullptr, "registry of ", what_, "s: cannot add a null ", what_);
    auto key = item->name();
    HP_CHECK(!key.empty(), "registry of ", what_, "s: cannot add a ", what_, " with an empty name");
    HP_CHECK(!contains(key), "registry of ", what_, "s: a ", what_, " named '", key,
             "' is already registered; pick another name");
    entries_.emplace_back(std::move(key), std::move(item));
  }

  // Throws hp::Error listing the valid names when `name` is unknown.
  std::shared_ptr<const T> get(const std::string& name) const {
    for (const auto& [key, item] : entries_) {
      if (key == name) return item;
    }
    HP_CHECK(false, "unknown ", what_, " '", name, "'; valid: ", names_list());
  }

  bool contains(const std::string& name) const {
    return std::any_of(entries_.begin(), entries_.end(),
                       [&](const auto& e) { return e.first == name; });
  }

  // In registration order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : entries_)
      out.push_back(e.first);
    return out;
  }

  // "a, b, c" (or joined by `separator`: " | " for help texts)
  std::string names_list(const std::string& separator = ", ") const {
    std::string out;
    for (const auto& e : entries_)
      out += (out.empty() ? "" : separator) + e.first;
    return out;
  }

 private:
  std::string what_;
  std::vector<std::pair<std::string, std::shared_ptr<const T>>> entries_;
};

}  // namespace hp::common
