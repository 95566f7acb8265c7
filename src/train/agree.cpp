#include "agree.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

#include <ATen/ATen.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/common/crc32.h"

namespace hp::train {

void run_agreed(const comm::World& world, const std::function<void()>& fn) {
  std::string error;
  try {
    fn();
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "an error without a message";
  }
  if (world.size() > 1) {
    // Row r: rank r's flag, then its message as byte values (zeros elsewhere), summed.
    constexpr int64_t kMaxText = 2048;
    auto texts = at::zeros({world.size(), kMaxText + 1}, at::kFloat);
    if (!error.empty()) {
      texts[world.rank()][0] = 1.0F;
      const auto n = std::min<int64_t>(kMaxText, static_cast<int64_t>(error.size()));
      auto bytes = at::empty({n}, at::kByte);
      std::memcpy(bytes.data_ptr<uint8_t>(), error.data(), static_cast<size_t>(n));
      texts[world.rank()].narrow(0, 1, n).copy_(bytes);
    }
    texts = comm::all_reduce(world.group(), texts);
    for (int r = 0; r < world.size(); ++r) {
      if (texts[r][0].item<float>() == 0.0F) continue;
      if (r == world.rank()) break;  // this rank's own message, in full
      const auto chars = texts[r].narrow(0, 1, kMaxText).to(at::kByte).contiguous();
      const auto* p = chars.data_ptr<uint8_t>();
      error.assign(p, std::find(p, p + kMaxText, uint8_t{0}));
      break;
    }
  }
  if (!error.empty()) throw hp::Error(error);
}

void check_same_on_every_rank(const comm::World& world, const std::string& text,
                              const std::string& what, const std::string& fix) {
  if (world.size() == 1) return;
  // Row r: rank r's CRC (zeros elsewhere), summed: one all-reduce, like run_agreed.
  auto crcs = at::zeros({world.size()}, at::kLong);
  crcs[world.rank()] = static_cast<int64_t>(common::crc32(text.data(), text.size()));
  crcs = comm::all_reduce(world.group(), crcs);
  const auto* v = crcs.data_ptr<int64_t>();
  for (int r = 1; r < world.size(); ++r) {
    HP_CHECK(v[r] == v[0], what, " differs between ranks (rank ", r, "'s differs from rank 0's); ",
             "this rank's: ", text, ". ", fix);
  }
}

}  // namespace hp::train
