// The copy task's batches (hp/train/data.h): with --copy-min-block each row copies a block of its
// own length after unlabeled random tokens; the layout is checked token by token here.
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/common/check.h"
#include "hp/train/data.h"
#include "hp/train/preflight.h"

namespace {

using hp::train::TrainOptions;

TrainOptions copy_options(int64_t seq, int64_t batch, int64_t min_block) {
  TrainOptions o;
  o.seq_len = seq;
  o.batch = batch;
  o.model.vocab = 16;
  o.copy_min_block = min_block;
  return o;
}

// The copied block's length of one row, checked: the labeled positions are one run ending at
// S - 2, each label is the next token, and the row ends with the same block twice.
int64_t checked_block(const at::Tensor& ids, const at::Tensor& labels, int64_t vocab) {
  const int64_t s = ids.size(0);
  EXPECT_TRUE(ids.ge(1).all().item<bool>() && ids.lt(vocab).all().item<bool>());
  const auto labeled = labels.ne(-100);
  const int64_t n = labeled.sum().item<int64_t>();
  EXPECT_GE(n, 1);
  const int64_t first = s - 1 - n;  // the last position (s - 1) predicts nothing
  EXPECT_TRUE(labeled.narrow(0, first, n).all().item<bool>()) << "one run ending at S - 2";
  EXPECT_TRUE(labels.narrow(0, first, n).equal(ids.narrow(0, first + 1, n)));
  // n labels: the last token of the first copy predicts the second copy's first, and so on.
  const int64_t block = n;
  EXPECT_TRUE(ids.narrow(0, s - block, block).equal(ids.narrow(0, s - 2 * block, block)));
  return block;
}

TEST(CopyTask, TheWholeRowByDefault) {
  const auto o = copy_options(64, 4, 0);
  const auto b = hp::train::make_batch(o, hp::train::Corpus(), 1);
  for (int64_t r = 0; r < o.batch; ++r)
    EXPECT_EQ(checked_block(b.ids[r], b.labels[r], o.model.vocab), 32);
}

TEST(CopyTask, MinBlockVariesTheCopyDistancePerRowAndStaysDeterministic) {
  const auto o = copy_options(64, 8, 4);
  std::set<int64_t> lengths;
  for (int64_t step = 1; step <= 4; ++step) {
    const auto b = hp::train::make_batch(o, hp::train::Corpus(), step);
    const auto again = hp::train::make_batch(o, hp::train::Corpus(), step);
    EXPECT_TRUE(b.ids.equal(again.ids) && b.labels.equal(again.labels));
    for (int64_t r = 0; r < o.batch; ++r) {
      const int64_t block = checked_block(b.ids[r], b.labels[r], o.model.vocab);
      EXPECT_GE(block, 4);
      EXPECT_LE(block, 32);
      lengths.insert(block);
    }
  }
  EXPECT_GE(lengths.size(), 8u) << "32 rows drawn from 29 lengths";
}

// Packed: every row holds the same cuts (doc_ids 0, 1, ... in runs of even lengths >= 8 that
// cover the row), each document a copy task of its own (labels only inside it, the last token of
// each document labelled -100), and the cuts vary with the step.
TEST(CopyTask, PackedDocumentsAreCopyTasksCutAlikeInEveryRow) {
  auto o = copy_options(128, 3, 0);
  o.pack_documents = true;
  std::set<std::vector<int64_t>> cuts_seen;
  for (int64_t step = 1; step <= 4; ++step) {
    const auto b = hp::train::make_batch(o, hp::train::Corpus(), step);
    ASSERT_TRUE(b.doc_ids.defined());
    ASSERT_EQ(b.doc_ids.sizes(), b.ids.sizes());
    std::vector<int64_t> cuts{0};
    const auto ids0 = b.doc_ids[0];
    for (int64_t t = 1; t < o.seq_len; ++t) {
      const int64_t step_up = ids0[t].item<int64_t>() - ids0[t - 1].item<int64_t>();
      ASSERT_TRUE(step_up == 0 || step_up == 1) << "position " << t;
      if (step_up == 1) cuts.push_back(t);
    }
    cuts.push_back(o.seq_len);
    EXPECT_EQ(ids0[0].item<int64_t>(), 0);
    EXPECT_GE(cuts.size(), 3u) << "at least two documents in 128 tokens";
    for (int64_t r = 1; r < o.batch; ++r)
      EXPECT_TRUE(b.doc_ids[r].equal(ids0)) << "row " << r << " of step " << step;
    for (size_t d = 0; d + 1 < cuts.size(); ++d) {
      const int64_t len = cuts[d + 1] - cuts[d];
      EXPECT_EQ(len % 2, 0) << "document " << d;
      EXPECT_GE(len, 8) << "document " << d;
      for (int64_t r = 0; r < o.batch; ++r) {
        EXPECT_EQ(checked_block(b.ids[r].narrow(0, cuts[d], len),
                                b.labels[r].narrow(0, cuts[d], len), o.model.vocab),
                  len / 2)
            << "document " << d << " of row " << r;
      }
    }
    cuts_seen.insert(cuts);
  }
  EXPECT_GE(cuts_seen.size(), 2u) << "the cuts are drawn per step";
}

TEST(CopyTask, MinBlockIsCheckedAgainstTheTask) {
  auto expect_refused = [](const TrainOptions& o, const std::string& text) {
    try {
      hp::train::check_options(o);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const hp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_refused(copy_options(64, 1, 33), "--copy-min-block 33 must be in [2, --seq-len / 2 = 32]");
  expect_refused(copy_options(64, 1, 1), "--copy-min-block 1 must be in [2");
  auto packed = copy_options(64, 1, 8);
  packed.pack_documents = true;
  expect_refused(packed, "drop it with --data or --pack-documents");
  EXPECT_NO_THROW(hp::train::check_options(copy_options(64, 1, 32)));
}

}  // namespace
