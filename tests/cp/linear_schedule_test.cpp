// The communication schedule of linear-attention CP, from the recording group: what each mode
// issues in forward and in backward, and nothing else (issue 14: "schedules asserted with the
// recording fake group").
//   ulysses                  forward: one all-to-all to heads, one back; backward: the inverse two
//   state_passing all_gather forward: one all-gather of [S | M]; backward: its reduce-scatter
//   state_passing p2p        forward: P-1 ring shifts of the state; backward: P-1 shifts back
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hp/comm/device_mesh.h"
#include "hp/cp/linear_mixer.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using hp::testing::run_ranks;

constexpr int64_t kB = 1, kT = 16, kH = 4, kK = 4, kV = 3;

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat);
}

struct Schedule {
  std::vector<std::string> forward, backward;
};

// GDN on this rank's contiguous shard of kT tokens under `mode`/`exchange`, recorded.
Schedule observe(comm::World& w, int64_t p, const std::string& mode, const std::string& exchange) {
  comm::DeviceMesh mesh(w, {{"cp", p}});
  auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, p));
  const int64_t t = kT / p, r = topo->cp_rank;
  attention::MixerInputs in;
  auto local = [&](uint64_t seed, std::vector<int64_t> shape) {
    return rnd(seed, shape).narrow(1, r * t, t).contiguous().requires_grad_(true);
  };
  in.q = local(1, {kB, kT, kH, kK});
  in.k = local(2, {kB, kT, kH, kK});
  in.v = local(3, {kB, kT, kH, kV});
  in.g = (rnd(4, {kB, kT, kH}).abs() * -0.5).narrow(1, r * t, t).contiguous().requires_grad_(true);
  in.beta = at::sigmoid(rnd(5, {kB, kT, kH})).narrow(1, r * t, t).contiguous().requires_grad_(true);
  attention::MixerOptions o;
  o.chunk_size = 4;
  LinearMixerCPOptions cp;
  cp.mode = mode;
  cp.state_exchange = exchange;
  auto& rec = *w.context().recorder;
  rec.clear();
  auto res = linear_mixer_cp(in, o, attention::GateKind::kPerHead, cp, *topo);
  Schedule s;
  s.forward = rec.schedule();
  rec.clear();
  res.out.sum().backward();
  s.backward = rec.schedule();
  return s;
}

TEST(LinearCPSchedule, UlyssesIsTwoAllToAllsEachWay) {
  run_ranks(2, [](comm::World& w) {
    auto s = observe(w, 2, "ulysses", "all_gather");
    // To heads: q, k (2 heads x K), v (2 x V), g and beta (2 each) of each head group packed,
    // [B, T/P, P, 26]; back: this rank's 2 value heads x V over the whole sequence.
    EXPECT_EQ(s.forward,
              (std::vector<std::string>{"all_to_all(cp)[1,8,2,26]", "all_to_all(cp)[1,16,1,6]"}));
    EXPECT_EQ(s.backward,
              (std::vector<std::string>{"all_to_all(cp)[1,8,2,6]", "all_to_all(cp)[1,16,1,26]"}));
  });
}

TEST(LinearCPSchedule, StatePassingAllGatherIsOneAllGatherOfTheSummaries) {
  run_ranks(4, [](comm::World& w) {
    auto s = observe(w, 4, "state_passing", "all_gather");
    // [S | M] of every rank: [1, B, HV, K, V + K]
    EXPECT_EQ(s.forward, (std::vector<std::string>{"all_gather(cp)[1,1,4,4,7]"}));
    EXPECT_EQ(s.backward, (std::vector<std::string>{"reduce_scatter(cp)[4,1,4,4,7]"}));
  });
}

TEST(LinearCPSchedule, StatePassingP2pIsAChainOfPMinusOneShifts) {
  run_ranks(4, [](comm::World& w) {
    auto s = observe(w, 4, "state_passing", "p2p");
    // P-1 = 3 ring steps, each one shift of a [B, HV, K, V] state to the next rank (receive from
    // the previous, send to the next); backward, the same steps the other way round.
    const int64_t r = w.rank(), prev = (r + 3) % 4, next = (r + 1) % 4;
    auto step = [](int64_t from, int64_t to) {
      return std::vector<std::string>{"recv(cp,peer=" + std::to_string(from) + ")[1,4,4,3]",
                                      "send(cp,peer=" + std::to_string(to) + ")[1,4,4,3]"};
    };
    auto chain = [&](int64_t from, int64_t to) {
      std::vector<std::string> out;
      for (int i = 0; i < 3; ++i) {
        auto one = step(from, to);
        out.insert(out.end(), one.begin(), one.end());
      }
      return out;
    };
    EXPECT_EQ(s.forward, chain(prev, next));
    EXPECT_EQ(s.backward, chain(next, prev));
  });
}

}  // namespace
}  // namespace hp::cp
