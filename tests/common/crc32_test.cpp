// CRC-32 against the standard check value and Python's zlib.crc32 of the same bytes; pieces
// chain to the CRC of the whole.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "hp/common/crc32.h"

namespace hp::common {
namespace {

std::vector<unsigned char> pattern(size_t n) {
  std::vector<unsigned char> b(n);
  for (size_t i = 0; i < n; ++i)
    b[i] = static_cast<unsigned char>((i * 131 + 7) % 256);
  return b;
}

TEST(Crc32, MatchesZlib) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32(check.data(), check.size()), 0xCBF43926U);
  EXPECT_EQ(crc32(nullptr, 0), 0U);
  const auto b = pattern(1000);
  // python3 -c "import zlib; b=bytes((i*131+7)%256 for i in range(1000));
  // print(hex(zlib.crc32(b)))"
  EXPECT_EQ(crc32(b.data(), 1000), 0x1ed57bb9U);
  EXPECT_EQ(crc32(b.data(), 3), 0x45d3c3ebU);
  EXPECT_EQ(crc32(b.data(), 13), 0xe7be5425U);
  EXPECT_EQ(crc32_hex(0xCBF43926U), "0xcbf43926");
}

TEST(Crc32, PiecesChain) {
  const auto b = pattern(1000);
  const uint32_t whole = crc32(b.data(), b.size());
  for (size_t cut : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    EXPECT_EQ(crc32(b.data() + cut, b.size() - cut, crc32(b.data(), cut)), whole) << cut;
  }
  auto flipped = b;
  flipped[600] ^= 0x10;
  EXPECT_NE(crc32(flipped.data(), flipped.size()), whole);
}

}  // namespace
}  // namespace hp::common
