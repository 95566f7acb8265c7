#include <gtest/gtest.h>

#include "hp/common/check.h"
#include "hp/common/threads.h"

namespace hp::common {
namespace {

TEST(Check, UserErrorsCarryTheMessage) {
  try {
    const int cp = 3;
    HP_CHECK(cp % 2 == 0, "cp_size=", cp, " must be even; choose 2 or 4");
    FAIL();
  } catch (const hp::Error& e) {
    EXPECT_STREQ(e.what(), "cp_size=3 must be even; choose 2 or 4");
  }
}

TEST(Check, InternalAssertNamesTheLocation) {
  try {
    HP_INTERNAL_ASSERT(1 + 1 == 3, "math");
    FAIL();
  } catch (const hp::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("internal error: 1 + 1 == 3 failed at"), std::string::npos) << msg;
    EXPECT_NE(msg.find("check_test.cpp"), std::string::npos) << msg;
  }
}

TEST(Threads, RanksShareTheCores) {
  EXPECT_EQ(threads_per_rank(4, 2), 1);
  EXPECT_EQ(threads_per_rank(2, 8), 4);
  EXPECT_EQ(threads_per_rank(1, 2), 2);
  EXPECT_THROW(threads_per_rank(0, 2), hp::Error);
  auto env = child_thread_env(3);
  ASSERT_EQ(env.size(), 3u);
  EXPECT_EQ(env[0], (std::pair<std::string, std::string>{"OPENBLAS_NUM_THREADS", "3"}));
}

}  // namespace
}  // namespace hp::common
