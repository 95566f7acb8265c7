// The --data corpus (hp/train/data.h): what Corpus::load refuses with the option to change (a
// file of uint32 ids read as uint16, binary bytes as text, a file shorter than one window, an
// eod id that never occurs, a pipe), and the windows: every start that fits is drawn, the last
// included.
#include <sys/stat.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/common/check.h"
#include "hp/common/crc32.h"
#include "hp/train/data.h"
#include "hp/train/preflight.h"
#include "rank_harness.h"

namespace {

using hp::train::Corpus;
using hp::train::TrainOptions;

template <typename T>
std::string write_ids(const std::string& name, const std::vector<T>& ids) {
  const std::string path = hp::testing::scratch_dir() + "/" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(ids.data()),
          static_cast<std::streamsize>(ids.size() * sizeof(T)));
  return path;
}

TrainOptions data_options(const std::string& path, int64_t seq, int64_t vocab) {
  TrainOptions o;
  o.data = path;
  o.seq_len = seq;
  o.batch = 8;
  o.model.vocab = vocab;
  return o;
}

void expect_refused(const TrainOptions& o, const std::string& text) {
  HP_EXPECT_ERROR(Corpus::load(o), text);
}

TEST(Corpus, UInt32IdsReadAsUInt16AreRefused) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 512; ++i)
    ids.push_back(1 + (i * 7) % 300);
  const auto path = write_ids("wide.bin", ids);
  auto o = data_options(path, 16, 400);
  expect_refused(o, "looks like uint32 ids (low and high halves); pass --data-dtype uint32");
  o.data_dtype = "uint32";
  EXPECT_EQ(Corpus::load(o).size(), 512);
  // Genuine uint16 ids with zeros among them pass.
  std::vector<uint16_t> narrow;
  for (uint16_t i = 0; i < 512; ++i)
    narrow.push_back(i % 3 == 0 ? 0 : i % 50);
  EXPECT_EQ(Corpus::load(data_options(write_ids("narrow.bin", narrow), 16, 64)).size(), 512);
}

// The corpus holds the file at its own width (it held int64 ids: 8x a text file per rank), and
// its fingerprint is still the CRC-32 of the int64 ids, as checkpoints recorded it before.
TEST(Corpus, HeldAtTheFilesWidthWithTheSameFingerprint) {
  std::vector<uint16_t> narrow;
  for (int i = 0; i < 3000; ++i)
    narrow.push_back(static_cast<uint16_t>(40000 + (i * 37) % 1000));  // above int16's range
  const auto c = Corpus::load(data_options(write_ids("width.bin", narrow), 16, 65536));
  EXPECT_EQ(c.bytes(), 6000);
  std::vector<int64_t> wide_ids(narrow.begin(), narrow.end());
  const auto wide = at::tensor(wide_ids);
  const uint32_t crc = hp::common::crc32(wide.data_ptr(), wide_ids.size() * sizeof(int64_t));
  EXPECT_EQ(c.fingerprint(), "3000 tokens, CRC-32 " + hp::common::crc32_hex(crc));
  EXPECT_TRUE(c.ids(10, 5).equal(wide.narrow(0, 10, 5)));
  // uint32 ids past 2^31 stay unsigned.
  const std::vector<uint32_t> big(64, 3000000000u);
  auto o = data_options(write_ids("big.bin", big), 16, int64_t{1} << 32);
  o.data_dtype = "uint32";
  const auto b = Corpus::load(o);
  EXPECT_EQ(b.bytes(), 256);
  EXPECT_EQ(b.ids(0, 1).item<int64_t>(), 3000000000);
  // Text: one byte a token.
  const std::string text = hp::testing::scratch_dir() + "/width.txt";
  std::ofstream(text) << std::string(100, 'a');
  EXPECT_EQ(Corpus::load(data_options(text, 16, 256)).bytes(), 100);
}

// Past one chunk (2^20 tokens): the checks and the fingerprint see every chunk.
TEST(Corpus, ChecksAndFingerprintCoverEveryChunk) {
  std::vector<uint16_t> ids((1 << 20) + 4096, 1);
  ids[(1 << 20) + 100] = 7;  // the only eod, in the second chunk
  ids.back() = 900;          // the largest id, last
  const auto path = write_ids("chunks.bin", ids);
  expect_refused(data_options(path, 16, 900), "holds token ids up to 900 but --vocab is 900");
  auto o = data_options(path, 16, 901);
  o.pack_documents = true;
  o.eod_id = 7;
  const auto c = Corpus::load(o);
  std::vector<int64_t> wide_ids(ids.begin(), ids.end());
  const uint32_t crc = hp::common::crc32(wide_ids.data(), wide_ids.size() * sizeof(int64_t));
  EXPECT_EQ(c.fingerprint(),
            std::to_string(ids.size()) + " tokens, CRC-32 " + hp::common::crc32_hex(crc));
}

// The memory check counts each rank's copy of the tokens and says so.
TEST(Corpus, TheMemoryCheckCountsTheTokens) {
  const std::string text = hp::testing::scratch_dir() + "/counted.txt";
  std::ofstream(text) << std::string(3 << 20, 'a');
  auto o = data_options(text, 16, 256);
  o.memory_limit = 1 << 20;
  HP_EXPECT_ERROR(hp::train::preflight(o, 0, 2), "+ 6 MiB for --data's tokens (2 x 3 MiB)");
}

TEST(Corpus, BinaryBytesAsTextAreRefused) {
  const auto path = write_ids("ids.txt", std::vector<uint16_t>(64, 7));
  expect_refused(data_options(path, 16, 256),
                 "holds NUL bytes, so it is not text; a file of token ids must be named *.bin");
}

// A window and its next tokens need seq_len + 1 tokens: a file of exactly that many is enough
// (it was refused, and one more token gave a single start); every start is drawn, the last too.
TEST(Corpus, EveryWindowThatFitsIsDrawn) {
  std::vector<uint16_t> ids;
  for (uint16_t i = 0; i < 20; ++i)
    ids.push_back(i);
  const auto path = write_ids("short.bin", ids);
  expect_refused(data_options(path, 20, 32),
                 "has 20 tokens; a window of --seq-len 20 and its next tokens need 21: use "
                 "--seq-len 19 or less");
  const auto exact = data_options(path, 19, 32);
  const auto corpus = Corpus::load(exact);
  auto b = hp::train::make_batch(exact, corpus, 1);
  EXPECT_TRUE(b.ids[0].equal(at::arange(0, 19, at::kLong)));
  EXPECT_TRUE(b.labels[0].equal(at::arange(1, 20, at::kLong)));
  const auto some = data_options(path, 16, 32);
  const auto c = Corpus::load(some);
  std::set<int64_t> starts;
  for (int64_t step = 1; step <= 8; ++step) {
    auto batch = hp::train::make_batch(some, c, step);
    for (int64_t r = 0; r < some.batch; ++r)
      starts.insert(batch.ids[r][0].item<int64_t>());
  }
  EXPECT_EQ(starts, (std::set<int64_t>{0, 1, 2, 3})) << "starts 0 .. N - S - 1 = 3";
}

TEST(Corpus, AnEodIdThatNeverOccursIsRefused) {
  auto o = data_options(write_ids("no_eod.bin", std::vector<uint16_t>(64, 5)), 16, 32);
  o.pack_documents = true;
  o.eod_id = 9;
  expect_refused(o, "--eod-id 9 never occurs in --data");
  o.eod_id = 5;
  EXPECT_NO_THROW(Corpus::load(o));
}

TEST(Corpus, APipeIsRefusedBeforeItIsRead) {
  const std::string path = hp::testing::scratch_dir() + "/fifo";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  HP_EXPECT_ERROR(hp::train::check_data_path(path),
                  "is not a regular file (a pipe, socket or device)");
}

TEST(Corpus, TheCopyTaskNeedsTwoTokens) {
  TrainOptions o;
  o.model.vocab = 1;
  HP_EXPECT_ERROR(hp::train::check_options(o), "--vocab 1 must be >= 2 for the copy task");
}

}  // namespace
