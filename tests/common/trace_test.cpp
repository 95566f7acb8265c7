#include <gtest/gtest.h>

#include "hp/common/trace.h"

namespace hp::common {
namespace {

TEST(Trace, ChromeJsonRoundTrip) {
  Tracer t;
  const int64_t now = Tracer::now_us();
  t.record({"all_to_all", "comm", 1, now, now + 50, "cp", 4096});
  t.record({"attention", "compute", 0, now, now + 80, "", -1});
  const std::string path = ::testing::TempDir() + "/hp_trace_rt.json";
  write_chrome_trace(path, t.events());
  auto back = read_chrome_trace(path);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].name, "all_to_all");
  EXPECT_EQ(back[0].group, "cp");
  EXPECT_EQ(back[0].bytes, 4096);
  EXPECT_EQ(back[0].end_us - back[0].begin_us, 50);
  EXPECT_EQ(back[1].rank, 0);
  Tracer off(false);
  off.record({"x", "comm", 0, 0, 1, "", -1});
  EXPECT_TRUE(off.events().empty());
}

}  // namespace
}  // namespace hp::common
