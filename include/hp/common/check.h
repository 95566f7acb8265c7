// Checks and errors used across hyperparallel.
//
// Two tiers, as in c10 (TORCH_CHECK / TORCH_INTERNAL_ASSERT):
//   HP_CHECK(cond, parts...)            a condition a *user* can violate (bad input, bad config).
//                                       Always on. The message must name the field, the value,
//                                       the constraint and what to change.
//   HP_INTERNAL_ASSERT(cond, parts...)  an invariant of the library itself; a failure is our bug.
// Both throw hp::Error (never abort), so threads-as-ranks tests can catch and report them.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace hp {

// Every error hyperparallel raises for a user-visible problem.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Raised when a collective fails in the backend (dead peer, timeout, transport error).
// The message names the op, the group and the rank.
class CommError : public Error {
 public:
  explicit CommError(const std::string& what) : Error(what) {}
};

namespace common {

// Concatenates any streamable values into one string.
template <typename... Parts>
std::string str_cat(Parts&&... parts) {
  std::ostringstream out;
  if constexpr (sizeof...(Parts) > 0) (out << ... << std::forward<Parts>(parts));
  return out.str();
}

[[noreturn]] void throw_check_failure(const char* cond, const char* file, int line,
                                      const std::string& msg);
[[noreturn]] void throw_internal_failure(const char* cond, const char* file, int line,
                                         const std::string& msg);

}  // namespace common
}  // namespace hp

#define HP_CHECK(cond, ...)                                                  \
  do {                                                                       \
    if (!(cond)) {                                                           \
      ::hp::common::throw_check_failure(#cond, __FILE__, __LINE__,           \
                                        ::hp::common::str_cat(__VA_ARGS__)); \
    }                                                                        \
  } while (false)

#define HP_INTERNAL_ASSERT(cond, ...)                                           \
  do {                                                                          \
    if (!(cond)) {                                                              \
      ::hp::common::throw_internal_failure(#cond, __FILE__, __LINE__,           \
                                           ::hp::common::str_cat(__VA_ARGS__)); \
    }                                                                           \
  } while (false)
