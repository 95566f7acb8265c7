#include <gtest/gtest.h>

#include "hp/comm/netaddr.h"
#include "hp/common/check.h"
#include "rank_harness.h"

namespace hp::comm {
namespace {

TEST(NetAddr, LocalAddressTowardsAHost) {
  EXPECT_EQ(local_address_towards("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(local_address_towards("localhost"), "127.0.0.1");
  EXPECT_TRUE(is_loopback_host("127.0.0.2"));
  EXPECT_FALSE(is_loopback_host("10.0.0.1"));
  HP_EXPECT_ERROR(local_address_towards("no-such-host.invalid"),
                  "cannot resolve 'no-such-host.invalid'");
}

}  // namespace
}  // namespace hp::comm
