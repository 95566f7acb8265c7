#include "hp/common/host_allocator.h"

#include <unistd.h>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

namespace hp::common {
namespace {

constexpr int64_t kMiB = int64_t(1) << 20;

HostCacheOptions small_blocks() {
  HostCacheOptions o;
  o.min_block_bytes = kMiB;
  o.max_cached_bytes = 64 * kMiB;
  return o;
}

int64_t page_bytes() {
  return sysconf(_SC_PAGESIZE);
}

TEST(HostBlockCache, AFreedBlockIsHandedOutAgainForTheSameSize) {
  HostBlockCache cache(small_blocks());
  void* a = cache.allocate(4 * kMiB);
  std::memset(a, 1, 4 * kMiB);
  cache.free(a);
  EXPECT_EQ(cache.stats().cached_bytes, 4 * kMiB);
  void* b = cache.allocate(4 * kMiB);
  EXPECT_EQ(a, b);
  const auto s = cache.stats();
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.live_bytes, 4 * kMiB);
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.system_bytes, 4 * kMiB);
  cache.free(b);
}

TEST(HostBlockCache, BlocksAreAlignedAndSmallOnesAreNotCached) {
  HostBlockCache cache(small_blocks());
  for (size_t n : {size_t(0), size_t(1), size_t(100), size_t(kMiB - 1), size_t(kMiB + 3)}) {
    void* p = cache.allocate(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << n;
    if (n > 0) std::memset(p, 7, n);
    cache.free(p);
  }
  const auto s = cache.stats();
  // Only the block of at least min_block_bytes, in whole pages.
  EXPECT_EQ(s.cached_bytes, kMiB + page_bytes());
  EXPECT_EQ(s.misses, 1);
  cache.free(nullptr);  // ignored
}

// Best fit: a smaller request takes the front of a freed range; freed neighbours merge again.
TEST(HostBlockCache, ASmallerRequestSplitsAFreedRangeAndFreedNeighboursMerge) {
  HostBlockCache cache(small_blocks());
  auto* a = static_cast<char*>(cache.allocate(8 * kMiB));
  cache.free(a);
  auto* b = static_cast<char*>(cache.allocate(3 * kMiB));
  auto* c = static_cast<char*>(cache.allocate(5 * kMiB));
  EXPECT_EQ(b, a);
  EXPECT_EQ(c, a + 3 * kMiB);
  std::memset(b, 1, 3 * kMiB);
  std::memset(c, 2, 5 * kMiB);
  auto s = cache.stats();
  EXPECT_EQ(s.hits, 2);
  EXPECT_EQ(s.system_bytes, 8 * kMiB);  // nothing beyond the first block's pages
  EXPECT_EQ(s.arena_bytes, 8 * kMiB);
  cache.free(b);
  cache.free(c);
  EXPECT_EQ(cache.allocate(8 * kMiB), a);  // one range again
  cache.free(a);
}

// With nothing free that fits, the arena grows from a free range at its end: only the
// difference is new.
TEST(HostBlockCache, TheArenaGrowsOnlyByWhatNoFreeRangeHolds) {
  HostBlockCache cache(small_blocks());
  auto* a = static_cast<char*>(cache.allocate(4 * kMiB));
  auto* b = static_cast<char*>(cache.allocate(2 * kMiB));
  cache.free(b);
  auto* c = static_cast<char*>(cache.allocate(3 * kMiB));
  EXPECT_EQ(c, b);
  const auto s = cache.stats();
  EXPECT_EQ(s.arena_bytes, 7 * kMiB);
  EXPECT_EQ(s.system_bytes, 7 * kMiB);
  EXPECT_EQ(s.misses, 3);
  std::memset(c, 3, 3 * kMiB);
  cache.free(a);
  cache.free(c);
}

// A step that repeats the last one's allocations (a training loop) takes no new pages, however
// its sizes interleave.
TEST(HostBlockCache, ARepeatedStepTakesNoNewPages) {
  auto o = small_blocks();
  o.max_resident_over_peak = 4;  // the bounds are the next tests' subject
  o.max_cached_bytes = HostCacheOptions{}.max_cached_bytes;
  HostBlockCache cache(o);
  auto step = [&cache] {
    std::mt19937 rng(11);
    const std::vector<int64_t> sizes = {1, 8, 16, 24, 32, 3};
    std::vector<void*> live;
    for (int i = 0; i < 400; ++i) {
      if (!live.empty() && (rng() % 3 == 0 || live.size() >= 10)) {
        const size_t j = rng() % live.size();
        cache.free(live[j]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
      } else {
        live.push_back(cache.allocate(sizes[rng() % sizes.size()] * kMiB));
      }
    }
    for (void* p : live)
      cache.free(p);
  };
  step();
  const auto first = cache.stats();
  step();
  step();
  const auto after = cache.stats();
  EXPECT_EQ(after.system_bytes, first.system_bytes);
  EXPECT_EQ(after.misses, first.misses);
  EXPECT_EQ(after.arena_bytes, first.arena_bytes);
  EXPECT_EQ(after.live_bytes, 0);
  EXPECT_LE(after.arena_bytes, 1.5 * after.budget_bytes);  // best fit packs them closely
}

// What stays resident: live + cached <= max_resident_over_peak x the peak live total, and
// cached <= max_cached_bytes, after every call.
TEST(HostBlockCache, ResidentBytesStayUnderTheirBound) {
  HostBlockCache cache(small_blocks());
  std::mt19937 rng(7);
  std::vector<void*> live;
  std::vector<int64_t> sizes = {1, 2, 3, 5, 8, 13};
  for (int i = 0; i < 3000; ++i) {
    if (!live.empty() && rng() % 2 == 0) {
      const size_t j = rng() % live.size();
      cache.free(live[j]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
    } else if (live.size() < 12) {
      live.push_back(cache.allocate(sizes[rng() % sizes.size()] * kMiB));
    }
    const auto s = cache.stats();
    ASSERT_LE(s.live_bytes + s.cached_bytes, 1.25 * s.budget_bytes) << "after call " << i;
    ASSERT_LE(s.cached_bytes, 64 * kMiB);
    ASSERT_LE(s.live_bytes + s.cached_bytes, s.arena_bytes);
  }
  EXPECT_GT(cache.stats().hits, 1000);  // most requests are served from free ranges
  for (void* p : live)
    cache.free(p);
}

TEST(HostBlockCache, CachedBytesStayUnderTheirCapAndReleaseGivesThemBack) {
  auto o = small_blocks();
  o.max_cached_bytes = 6 * kMiB;
  HostBlockCache cache(o);
  void* a = cache.allocate(4 * kMiB);
  void* b = cache.allocate(4 * kMiB);
  cache.free(a);
  EXPECT_EQ(cache.stats().cached_bytes, 4 * kMiB);
  cache.free(b);  // merged with a: 8 would exceed the cap of 6, so the range's last 2 go back
  auto s = cache.stats();
  EXPECT_EQ(s.cached_bytes, 6 * kMiB);
  EXPECT_EQ(s.evictions, 1);
  void* c = cache.allocate(4 * kMiB);  // the range's resident front is reused: no fresh page
  EXPECT_EQ(c, a);
  EXPECT_EQ(cache.stats().system_bytes, 8 * kMiB);
  void* d = cache.allocate(4 * kMiB);  // the rest: 2 resident, the 2 given back faulted in
  EXPECT_EQ(d, b);
  EXPECT_EQ(cache.stats().system_bytes, 10 * kMiB);
  cache.free(c);
  cache.free(d);
  cache.release();
  s = cache.stats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.arena_bytes, 0);  // nothing live: the whole arena is uncommitted
}

TEST(HostBlockCache, ResetBudgetAndMarkRestartAtTheLiveBytes) {
  HostBlockCache cache(small_blocks());
  void* a = cache.allocate(8 * kMiB);
  void* b = cache.allocate(2 * kMiB);
  cache.free(a);
  cache.reset_budget();
  auto s = cache.stats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.budget_bytes, 2 * kMiB);
  EXPECT_EQ(s.arena_bytes, 10 * kMiB);  // b is live at the end
  cache.mark();
  void* c = cache.allocate(3 * kMiB);
  EXPECT_EQ(c, a);  // the range given back is reused, with fresh pages
  EXPECT_EQ(cache.stats().system_bytes, 13 * kMiB);
  cache.free(c);
  s = cache.stats();
  EXPECT_EQ(s.marked_peak_bytes, 5 * kMiB);  // 2 live at the mark + 3
  cache.free(b);
}

TEST(HostBlockCache, ThreadsShareOneCache) {
  HostBlockCache cache(small_blocks());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, t] {
      for (int i = 0; i < 200; ++i) {
        const int64_t n = (1 + (i + t) % 3) * kMiB;
        auto* p = static_cast<unsigned char*>(cache.allocate(n));
        p[0] = static_cast<unsigned char>(t);
        p[n - 1] = static_cast<unsigned char>(i);
        cache.free(p);
      }
    });
  }
  for (auto& th : threads)
    th.join();
  const auto s = cache.stats();
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_EQ(s.hits + s.misses, 800);
  EXPECT_LE(s.cached_bytes, 1.25 * s.budget_bytes);
}

TEST(HostBlockCache, OptionsAreCheckedByName) {
  HostCacheOptions o;
  o.min_block_bytes = 0;
  try {
    HostBlockCache cache(o);
    FAIL() << "min_block_bytes = 0 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("min_block_bytes"), std::string::npos) << e.what();
  }
  HostCacheOptions r;
  r.max_resident_over_peak = 0.5;
  try {
    HostBlockCache cache(r);
    FAIL() << "max_resident_over_peak = 0.5 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("max_resident_over_peak"), std::string::npos) << e.what();
  }
  try {
    apply_host_allocator_choice("jemalloc");
    FAIL() << "an unknown --host-allocator was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("caching"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("system"), std::string::npos) << e.what();
  }
  EXPECT_EQ(installed_host_cache(), nullptr);  // neither call installed anything
}

// Installed (each test case runs in its own process under ctest), LibTorch's tensors come from
// the cache: a tensor freed and made again of the same size reuses the block.
TEST(HostBlockCache, InstalledTensorsReuseFreedBlocks) {
  auto& cache = install_caching_host_allocator();
  EXPECT_EQ(installed_host_cache(), &cache);
  EXPECT_EQ(&install_caching_host_allocator(), &cache);  // once
  const void* first = nullptr;
  {
    auto t = at::ones({1024, 1024}, at::kFloat);  // 4 MiB
    first = t.data_ptr();
    EXPECT_FLOAT_EQ(t.sum().item<float>(), 1024.0f * 1024.0f);
  }
  const auto hits = cache.stats().hits;
  auto u = at::zeros({1024, 1024}, at::kFloat);
  EXPECT_EQ(u.data_ptr(), first);
  EXPECT_EQ(cache.stats().hits, hits + 1);
  EXPECT_FLOAT_EQ(u.sum().item<float>(), 0.0f);
  // Raw allocations through c10 (what some kernels use) go through the same cache.
  auto* alloc = c10::GetCPUAllocator();
  void* raw = alloc->raw_allocate(2 * kMiB);
  std::memset(raw, 0, 2 * kMiB);
  alloc->raw_deallocate(raw);
  EXPECT_GE(cache.stats().cached_bytes, 2 * kMiB);
  release_host_cache();
  EXPECT_EQ(cache.stats().cached_bytes, 0);
}

}  // namespace
}  // namespace hp::common
