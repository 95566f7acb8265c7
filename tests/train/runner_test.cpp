// One step's loss normalisation over gradient accumulation (src/train/runner.h): the step's loss
// and gradients are those of one batch holding every micro-batch's rows, the token mean over
// the whole step, even when the micro-batches hold different numbers of labelled tokens.
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "hp/comm/device_mesh.h"
#include "train/runner.h"

namespace {

using hp::train::TrainOptions;

TrainOptions tiny(int64_t batch, int64_t grad_accum) {
  TrainOptions o;
  o.seq_len = 32;
  o.batch = batch;
  o.grad_accum = grad_accum;
  o.copy_min_block = 2;  // each row labels its own number of tokens
  o.seed = 5;
  o.model.vocab = 16;
  o.model.layers = 1;
  o.model.hidden = 32;
  o.model.heads = 2;
  o.model.kv_heads = 1;
  o.model.head_dim = 16;
  o.model.ffn = 64;
  return o;
}

// Cross entropy by hand in float64: the sum over labelled tokens of -log softmax(logits)[label].
at::Tensor token_nll_sum(const at::Tensor& logits, const at::Tensor& labels) {
  auto l = logits.to(at::kDouble).reshape({-1, logits.size(-1)});
  auto y = labels.reshape({-1});
  auto keep = y.ne(-100);
  auto logp = l - l.exp().sum(-1, true).log();
  auto picked = logp.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1);
  return -(picked * keep.to(at::kDouble)).sum();
}

TEST(GradAccum, TheStepIsTheTokenMeanOfOneBatchOfAllRows) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto world = hp::comm::World::in_process(0, 1, store);
  hp::comm::DeviceMesh mesh(world, {{"dp_replicate", 1}, {"dp_shard", 1}, {"cp", 1}, {"tp", 1}});
  const TrainOptions o = tiny(1, 3);
  hp::train::Runner run(o, mesh, std::nullopt);
  run.make_optimizer(nullptr);
  const double loss = run.forward_backward(1, hp::train::Corpus());

  // The reference: the same initial model on one batch of the three micro-batches' rows.
  TrainOptions one = o;
  one.grad_accum = 1;
  hp::train::Runner ref(one, mesh, std::nullopt);
  std::vector<at::Tensor> ids, labels;
  std::vector<int64_t> counts;
  for (int64_t m = 0; m < o.grad_accum; ++m) {
    auto b = hp::train::make_batch(o, hp::train::Corpus(), 1, m);
    ids.push_back(b.ids);
    labels.push_back(b.labels);
    counts.push_back(b.labels.ne(-100).sum().item<int64_t>());
  }
  ASSERT_TRUE(counts[0] != counts[1] || counts[1] != counts[2])
      << "the micro-batches must label different numbers of tokens for this test to bite";
  auto all_ids = at::cat(ids);
  auto all_labels = at::cat(labels);
  auto pos = at::arange(o.seq_len, at::kLong).unsqueeze(0).expand_as(all_ids).contiguous();
  auto sum = token_nll_sum(ref.model->forward(all_ids, pos, at::Tensor()), all_labels);
  const double count = static_cast<double>(all_labels.ne(-100).sum().item<int64_t>());
  (sum / count).backward();
  EXPECT_NEAR(loss, (sum / count).item<double>(), 1e-5);

  // The mean of the micro-batches' means, what the step used to be, differs here.
  double mean_of_means = 0;
  for (int64_t m = 0; m < o.grad_accum; ++m) {
    auto s =
        token_nll_sum(ref.model->forward(ids[m], pos.narrow(0, 0, 1), at::Tensor()), labels[m]);
    mean_of_means += s.item<double>() / static_cast<double>(counts[m]) / o.grad_accum;
  }
  EXPECT_GT(std::abs(mean_of_means - loss), 1e-3);

  auto got = run.model->named_parameters();
  auto want = ref.model->named_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& p : got) {
    const auto& g = p.value().grad();
    const auto& r = want[p.key()].grad();
    ASSERT_TRUE(g.defined() && r.defined()) << p.key();
    const double rel =
        ((g.to(at::kDouble) - r.to(at::kDouble)).norm() / (r.to(at::kDouble).norm() + 1e-12))
            .item<double>();
    EXPECT_LT(rel, 1e-4) << p.key();
  }
}

// DSA's indexer loss is a mean over every query token of the step, labelled or not: with the
// copy task (which labels under half of the tokens) it was divided by the labelled count.
TEST(IndexLoss, IsAMeanOverEveryQueryOfTheStep) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto world = hp::comm::World::in_process(0, 1, store);
  hp::comm::DeviceMesh mesh(world, {{"dp_replicate", 1}, {"dp_shard", 1}, {"cp", 1}, {"tp", 1}});
  TrainOptions o = tiny(2, 2);
  o.model.mixer = "dsa";
  o.model.head_dim = 16;
  o.model.topk = 8;
  hp::train::Runner run(o, mesh, std::nullopt);
  run.make_optimizer(nullptr);
  run.forward_backward(1, hp::train::Corpus());
  ASSERT_TRUE(run.index_loss.has_value());

  // The same initial model's indexer losses (sums over their queries) on the step's rows.
  hp::train::Runner ref(o, mesh, std::nullopt);
  double sum = 0, labelled = 0;
  for (int64_t m = 0; m < o.grad_accum; ++m) {
    auto b = hp::train::make_batch(o, hp::train::Corpus(), 1, m);
    auto pos = at::arange(o.seq_len, at::kLong).unsqueeze(0).expand_as(b.ids).contiguous();
    ref.model->forward(b.ids, pos, at::Tensor());
    sum += ref.model->aux_loss().item<double>();
    labelled += static_cast<double>(b.labels.ne(-100).sum().item<int64_t>());
  }
  const double queries = static_cast<double>(o.batch * o.seq_len * o.grad_accum);
  ASSERT_LT(labelled, queries / 2) << "the test needs unlabelled tokens to bite";
  EXPECT_NEAR(*run.index_loss, sum / queries, 1e-6 * sum / queries);
}

}  // namespace
