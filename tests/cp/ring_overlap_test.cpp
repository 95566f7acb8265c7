// The ring's double buffering shown by the peer, not by program order: one rank enters late, so
// a chunk that has to pass through it cannot arrive before then; the waiting rank's trace must
// show the transfer launched before an attention call that ran wholly before its wait began.
// Forward, and each form of the backward (the blocks again, the kept blocks' accumulators, the
// query bundles). The schedules themselves: ring_schedule_test.cpp.
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "hp/comm/collectives.h"
#include "hp/comm/world.h"
#include "hp/common/trace.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using namespace hp::cp::testing;  // NOLINT: the float64 tests' module, inputs and shapes
using hp::testing::run_ranks;

constexpr int kP = 3;
constexpr int64_t kLateUs = 300000;  // how late the late rank enters each phase

// One receive as the watched rank's trace shows it.
struct Receive {
  int64_t launch = -1, arrived = -1, wait_begin = -1, wait_end = -1;
};

struct Phase {
  std::vector<Receive> receives;
  std::vector<common::TraceEvent> compute;  // attention calls and their backward
  int64_t late_woke = -1;                   // when the late rank entered this phase
};

// The watched rank's forward and backward (events between its barriers), with `late` entering
// both 300 ms after the others.
struct RingTrace {
  Phase forward, backward;
};

RingTrace trace_ring(const ContextParallelConfig& norm, int watch, int late) {
  auto tracer = std::make_shared<common::Tracer>();
  std::array<std::atomic<int64_t>, 2> woke{};  // the late rank's entry into forward, backward
  hp::testing::RankOptions o;
  o.tracer = tracer;
  o.verify_shapes = false;  // its shape exchange would wait for the late rank at every launch
  o.record = false;
  run_ranks(
      kP,
      [&](comm::World& w) {
        Direct m(true);
        apply_cp(m, w, norm, /*handoffs=*/false);
        const int64_t r = w.rank();
        auto mine = [&](uint64_t seed, at::IntArrayRef shape) {
          return shard_sequence(f64(seed, shape), 2, r, kP, false).requires_grad_(true);
        };
        auto q = mine(1, {1, kNq, kS, kDqk}), k = mine(2, {1, kNkv, kS, kDqk}),
             v = mine(3, {1, kNkv, kS, kDv});
        auto pause = [&](int phase) {
          comm::barrier(w.group());
          if (r != late) return;
          std::this_thread::sleep_for(std::chrono::microseconds(kLateUs));
          woke[phase] = common::Tracer::now_us();
        };
        pause(0);
        auto out = m.forward(q, k, v);
        pause(1);
        out.sum().backward();
      },
      o);
  std::vector<common::TraceEvent> mine;
  std::vector<int64_t> barrier_ends;
  for (const auto& e : tracer->events()) {
    if (e.rank != watch) continue;
    if (e.category == "comm" && e.name == "barrier") barrier_ends.push_back(e.end_us);
    mine.push_back(e);
  }
  EXPECT_EQ(barrier_ends.size(), 2u);
  RingTrace t;
  t.forward.late_woke = woke[0];
  t.backward.late_woke = woke[1];
  if (barrier_ends.size() != 2u) return t;
  // In recording order a transfer's "comm" event comes right before its "wait" event.
  for (size_t i = 0; i < mine.size(); ++i) {
    const auto& e = mine[i];
    if (e.begin_us < barrier_ends[0] && e.category != "comm") continue;
    Phase& ph = e.begin_us >= barrier_ends[1] ? t.backward : t.forward;
    if (e.category == "compute" && e.begin_us >= barrier_ends[0]) ph.compute.push_back(e);
    if (e.category == "comm" && e.name == "recv" && i + 1 < mine.size() &&
        mine[i + 1].name == "wait recv" && e.begin_us >= barrier_ends[0]) {
      ph.receives.push_back({e.begin_us, e.end_us, mine[i + 1].begin_us, mine[i + 1].end_us});
    }
  }
  return t;
}

// A receive the late rank held back (it completed only after that rank had woken) with an
// attention call (`compute`: "attention" or "attention_backward") that began after the receive
// was launched and ended before the wait for it began: the transfer flew while a block
// computed.
void expect_flies_while_a_block_computes(const Phase& ph, const std::string& compute) {
  ASSERT_FALSE(ph.receives.empty());
  ASSERT_GT(ph.late_woke, 0);
  bool held_back = false, overlapped = false;
  for (const auto& rcv : ph.receives) {
    if (rcv.arrived < ph.late_woke) continue;
    held_back = true;
    for (const auto& c : ph.compute) {
      if (c.name == compute && c.begin_us >= rcv.launch && c.end_us <= rcv.wait_begin)
        overlapped = true;
    }
  }
  EXPECT_TRUE(held_back) << "no receive waited for the late rank";
  EXPECT_TRUE(overlapped) << "no " << compute
                          << " call ran between a held-back receive's launch and its wait";
}

ContextParallelConfig ring(bool keep_blocks, RingBackward backward) {
  ContextParallelConfig cfg;
  cfg.algorithm = "ring";
  cfg.ring_keep_blocks = keep_blocks;
  cfg.ring_backward = backward;
  return *normalize(cfg, kP);
}

// Causal, contiguous shards, P = 3: rank 0's block reaches rank 2 through rank 1, so with rank 0
// late, rank 2's second receive is held back; it was launched before rank 2 attended rank 1's
// block (forward), and before rank 2 computed that block's gradients (backward, the blocks
// travelling again). Forward keeps at most two blocks because of this order: the one attended
// and the one arriving.
TEST(RingOverlap, TheNextBlockFliesWhileTheCurrentOneIsAttended) {
  const auto t = trace_ring(ring(false, RingBackward::kBlocks), /*watch=*/2, /*late=*/0);
  {
    SCOPED_TRACE("forward");
    EXPECT_EQ(t.forward.receives.size(), 2u);
    expect_flies_while_a_block_computes(t.forward, "attention");
  }
  {
    SCOPED_TRACE("backward, the blocks again");
    expect_flies_while_a_block_computes(t.backward, "attention_backward");
  }
}

// ring_backward=queries: the query bundles travel to rank r-1, so rank 2's reaches rank 0
// through rank 1; with rank 2 late, rank 0 computes rank 1's bundle while rank 2's is held back.
TEST(RingOverlap, TheNextQueryBundleFliesWhileTheCurrentOneIsAttended) {
  const auto t = trace_ring(ring(false, RingBackward::kQueries), /*watch=*/0, /*late=*/2);
  expect_flies_while_a_block_computes(t.backward, "attention_backward");
}

// ring_keep_blocks: only the dK/dV accumulators travel in backward. Rank 2 receives rank 0's
// block's accumulator from rank 1; with rank 1 late, rank 2 computes the gradients of the blocks
// it kept while that accumulator is on its way.
TEST(RingOverlap, KeptBlocksComputeWhileTheAccumulatorsTravel) {
  const auto t = trace_ring(ring(true, RingBackward::kAuto), /*watch=*/2, /*late=*/1);
  expect_flies_while_a_block_computes(t.backward, "attention_backward");
}

}  // namespace
}  // namespace hp::cp
