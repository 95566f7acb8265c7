#include "hp/common/host_allocator.h"

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
  EXPECT_EQ(s.cached_bytes, kMiB + 3);  // only the block of at least min_block_bytes
  EXPECT_EQ(s.misses, 1);
  cache.free(nullptr);  // ignored
}

// The cache never holds more than the system allocator would need at the program's peak:
// live + cached <= the largest live total so far.
TEST(HostBlockCache, LiveAndCachedBytesStayUnderThePeakLiveTotal) {
  HostBlockCache cache(small_blocks());
  void* a = cache.allocate(4 * kMiB);
  cache.free(a);                       // cached 4, budget 4
  void* b = cache.allocate(8 * kMiB);  // a miss: 8 live + 4 cached > 8, so the 4 is evicted
  auto s = cache.stats();
  EXPECT_EQ(s.evictions, 1);
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.budget_bytes, 8 * kMiB);
  cache.free(b);

  // Random sizes and lifetimes: the invariant after every call.
  std::mt19937 rng(7);
  std::vector<void*> live;
  std::vector<int64_t> sizes = {1, 2, 3, 5, 8};
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 2 == 0) {
      const size_t j = rng() % live.size();
      cache.free(live[j]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
    } else if (live.size() < 12) {
      live.push_back(cache.allocate(sizes[rng() % sizes.size()] * kMiB));
    }
    s = cache.stats();
    ASSERT_LE(s.live_bytes + s.cached_bytes, s.budget_bytes) << "after call " << i;
    ASSERT_LE(s.cached_bytes, 64 * kMiB);
  }
  EXPECT_GT(cache.stats().hits, 100);  // repeated sizes are served from the cache
  for (void* p : live)
    cache.free(p);
}

TEST(HostBlockCache, CachedBytesStayUnderTheirCapAndReleaseFreesThem) {
  auto o = small_blocks();
  o.max_cached_bytes = 6 * kMiB;
  HostBlockCache cache(o);
  void* a = cache.allocate(4 * kMiB);
  void* b = cache.allocate(4 * kMiB);
  cache.free(a);
  cache.free(b);  // 8 would exceed the cap of 6: b goes back to the system
  EXPECT_EQ(cache.stats().cached_bytes, 4 * kMiB);
  cache.release();
  EXPECT_EQ(cache.stats().cached_bytes, 0);
  EXPECT_EQ(cache.stats().evictions, 1);
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
  cache.mark();
  void* c = cache.allocate(3 * kMiB);
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
  EXPECT_LE(s.cached_bytes, s.budget_bytes);
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
