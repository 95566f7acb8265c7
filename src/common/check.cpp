#include "hp/common/check.h"

namespace hp::common {

void throw_check_failure(const char* /*cond*/, const char* /*file*/, int /*line*/,
                         const std::string& msg) {
  // User errors carry only the message: it already says what was wrong and what to change.
  throw Error(msg);
}

void throw_internal_failure(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(str_cat("hyperparallel internal error: ", cond, " failed at ", file, ":", line,
                      msg.empty() ? "" : ": ", msg, " (please report this as a bug)"));
}

}  // namespace hp::common
