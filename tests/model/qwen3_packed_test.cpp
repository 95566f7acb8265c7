// Packed documents through the Qwen3-style model: one forward over documents laid end to end
// (positions restarting per document) equals every document run alone, in one process and
// under CP (ring with head-tail balance, and ulysses), with shard_batch padding the sequence.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/masks.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/cp/apply.h"
#include "hp/cp/sequence.h"
#include "hp/model/qwen3.h"
#include "qwen3_test_util.h"
#include "rank_harness.h"

namespace hp::model {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kS = 30;  // padded to 32 under CP 2 with load balance

Qwen3Config small() {
  return testing::small_qwen3();
}

const std::vector<int64_t> kCuts{0, 7, 9, 22, kS};

at::Tensor tokens() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  return at::randint(0, 64, {1, kS}, gen, at::kLong);
}

// Every document alone (positions from 0), the logits concatenated: [1, kS, vocab].
at::Tensor each_document_alone(Qwen3& m, const at::Tensor& ids) {
  std::vector<at::Tensor> out;
  for (size_t d = 0; d + 1 < kCuts.size(); ++d) {
    const int64_t len = kCuts[d + 1] - kCuts[d];
    out.push_back(m->forward(ids.narrow(1, kCuts[d], len), at::arange(len).view({1, len})));
  }
  return at::cat(out, 1).detach();
}

TEST(Qwen3Packed, OneForwardEqualsEachDocumentAlone) {
  Qwen3 m(small());
  auto ids = tokens();
  auto docs = attention::document_ids_from_cu_seqlens(kCuts, kS);
  auto packed = m->forward(ids, attention::document_positions(docs), docs).detach();
  expect_close(packed, each_document_alone(m, ids), "packed vs alone", 1e-5, 1e-5);
  // Without the documents the same tokens mix across boundaries: the test can see a leak.
  auto mixed = m->forward(ids, attention::document_positions(docs)).detach();
  EXPECT_GT((mixed - packed).abs().max().item<double>(), 1e-3);
}

TEST(Qwen3Packed, UnderContextParallelismEqualsEachDocumentAlone) {
  Qwen3 ref(small());
  auto ids = tokens();
  auto expect = each_document_alone(ref, ids);
  auto docs = attention::document_ids_from_cu_seqlens(kCuts, kS);
  for (const auto& [algo, lb] :
       {std::pair<std::string, bool>{"ring", true}, {"ulysses", false}, {"all_gather", true}}) {
    run_ranks(2, [&, algo = algo, lb = lb](comm::World& w) {
      comm::DeviceMesh mesh(w, {{"cp", 2}});
      Qwen3 m(small());
      cp::ContextParallelConfig c;
      c.algorithm = algo;
      c.load_balance = lb;
      auto cfg = *cp::normalize(c, 2);
      auto topo = cp::CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
      testing::apply_cp_to_attention(*m, cfg, topo);
      const int64_t r = mesh.coordinate("cp");
      auto b = cp::shard_batch(ids, ids, r, 2, lb, docs.expand({1, kS}));
      ASSERT_EQ(b.doc_ids.size(1), lb ? 32 : kS);  // padding: one more document
      auto logits = m->forward(b.input_ids, b.position_ids, b.doc_ids).detach();
      auto all = comm::all_gather(mesh.group("cp"), logits.contiguous(), 0);
      auto full = cp::unshard_sequence({all.narrow(0, 0, 1), all.narrow(0, 1, 1)}, 1, lb);
      expect_close(full.narrow(1, 0, kS), expect, algo + " packed under CP", 1e-5, 1e-5);
    });
  }
}

}  // namespace
}  // namespace hp::model
