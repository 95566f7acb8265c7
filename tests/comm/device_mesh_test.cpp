#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "rank_harness.h"

namespace hp::comm {
namespace {

using hp::testing::run_ranks;

TEST(DeviceMesh, RowMajorLastDimFastest) {
  auto w = World::fake(5, 8);
  DeviceMesh mesh(w, {{"dp", 2}, {"cp", 2}, {"tp", 2}});
  EXPECT_EQ(mesh.coordinates_of(5), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(mesh.rank_at({1, 0, 1}), 5);
  EXPECT_EQ(mesh.coordinate("cp"), 0);
  EXPECT_EQ(mesh.group_ranks({"tp"}, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(mesh.group_ranks({"cp"}, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(mesh.group_ranks({"dp"}, 5), (std::vector<int>{1, 5}));
  // Flattened dims are taken in mesh order whatever order they are named in.
  EXPECT_EQ(mesh.group_ranks({"tp", "cp"}, 5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(mesh.group("tp").world_ranks(), (std::vector<int>{4, 5}));
  EXPECT_EQ(mesh.group("cp").rank(), 0);
  EXPECT_EQ(mesh.group("cp").name(), "cp");
}

TEST(DeviceMesh, SizesMustMultiplyToTheWorld) {
  try {
    DeviceMesh mesh(World::fake(0, 4), {{"cp", 3}, {"tp", 2}});
    FAIL() << "expected an error";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dims (cp=3, tp=2) multiply to 6 but the world has 4 "
                                         "ranks"),
              std::string::npos)
        << e.what();
  }
}

TEST(DeviceMesh, LookupNeverCreatesAGroup) {
  DeviceMesh mesh(World::fake(0, 4), {{"cp", 2}, {"tp", 2}});
  try {
    mesh.flattened_group({"cp", "tp"});
    FAIL() << "expected an error";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the group over {cp, tp} was not created"),
              std::string::npos)
        << e.what();
  }
  mesh.create_group({"tp", "cp"});
  EXPECT_EQ(mesh.flattened_group({"cp", "tp"}).size(), 4);
  EXPECT_EQ(mesh.flattened_group({"cp", "tp"}).name(), "cp+tp");
  try {
    mesh.group("dp");
    FAIL() << "expected an error";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no dim named 'dp'; the mesh has: cp, tp"),
              std::string::npos);
  }
}

TEST(DeviceMesh, SubGroupsCommunicateOverTheRightRanks) {
  run_ranks(4, [](World& w) {
    DeviceMesh mesh(w, {{"cp", 2}, {"tp", 2}}, MeshOptions{{{"cp", "tp"}}});
    const double r = w.rank();
    auto tp_sum = all_reduce(mesh.group("tp"), at::full({1}, r, at::kDouble)).item<double>();
    auto cp_sum = all_reduce(mesh.group("cp"), at::full({1}, r, at::kDouble)).item<double>();
    auto all = all_reduce(mesh.flattened_group({"cp", "tp"}), at::full({1}, r, at::kDouble))
                   .item<double>();
    // tp groups {0,1},{2,3}; cp groups {0,2},{1,3}.
    EXPECT_EQ(tp_sum, w.rank() < 2 ? 1.0 : 5.0);
    EXPECT_EQ(cp_sum, w.rank() % 2 == 0 ? 2.0 : 4.0);
    EXPECT_EQ(all, 6.0);
  });
}

TEST(RecordingFakeGroup, ListsTheIssuedScheduleWithoutPeers) {
  WorldOptions o;
  o.recorder = std::make_shared<CollectiveRecorder>();
  auto w = World::fake(1, 4, o);
  DeviceMesh mesh(w, {{"cp", 4}});
  auto& cp = mesh.group("cp");
  auto kv = all_gather(cp, at::ones({1, 2, 3, 8}), 2);
  EXPECT_EQ(kv.sizes(), (std::vector<int64_t>{1, 2, 12, 8}));
  auto q = all_to_all(cp, at::ones({1, 8, 3, 8}), 1, 2);
  EXPECT_EQ(q.sizes(), (std::vector<int64_t>{1, 2, 12, 8}));
  reduce_scatter(cp, kv, 2);
  EXPECT_EQ(o.recorder->schedule(),
            (std::vector<std::string>{"all_gather(cp)[1,2,3,8]", "all_to_all(cp)[1,8,3,8]",
                                      "reduce_scatter(cp)[1,2,12,8]"}));
  // Bytes are counted exactly as for a real group.
  EXPECT_EQ(w.context().counters.bytes(OpKind::kAllGather, "cp"), 3 * 48 * 4);
}

}  // namespace
}  // namespace hp::comm
