#include "hp/common/host_allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>

#include <c10/core/CPUAllocator.h>

#include "hp/common/check.h"
#include "hp/common/torch_compat.h"

namespace hp::common {
namespace {

// Every block starts with a header line holding its byte size; the caller's data follows it,
// so the data keeps the base's 64-byte alignment.
constexpr size_t kAlign = 64;
struct Header {
  int64_t bytes;
};
static_assert(sizeof(Header) <= kAlign, "the header must fit in the alignment line");

void* system_block(int64_t bytes) {
  void* base = nullptr;
  if (posix_memalign(&base, kAlign, static_cast<size_t>(bytes) + kAlign) != 0) {
    throw std::bad_alloc();
  }
  static_cast<Header*>(base)->bytes = bytes;
  return base;
}
char* data_of(void* base) {
  return static_cast<char*>(base) + kAlign;
}
void* base_of(void* data) {
  return static_cast<char*>(data) - kAlign;
}

}  // namespace

HostBlockCache::HostBlockCache(HostCacheOptions options) : options_(options) {
  HP_CHECK(options_.min_block_bytes >= 1,
           "HostCacheOptions.min_block_bytes = ", options_.min_block_bytes,
           ": must be at least 1 (blocks below it are not cached)");
  HP_CHECK(options_.max_cached_bytes >= 0,
           "HostCacheOptions.max_cached_bytes = ", options_.max_cached_bytes,
           ": must be at least 0 (0 caches nothing)");
}

HostBlockCache::~HostBlockCache() {
  release();
}

void* HostBlockCache::allocate(size_t bytes) {
  const auto n = static_cast<int64_t>(bytes);
  if (n < options_.min_block_bytes) return data_of(system_block(n));
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.live_bytes += n;
    stats_.budget_bytes = std::max(stats_.budget_bytes, stats_.live_bytes);
    stats_.marked_peak_bytes = std::max(stats_.marked_peak_bytes, stats_.live_bytes);
    auto it = free_.find(n);
    if (it != free_.end()) {
      void* base = it->second;
      free_.erase(it);
      stats_.cached_bytes -= n;
      ++stats_.hits;
      return data_of(base);
    }
    ++stats_.misses;
    stats_.system_bytes += n;
    // The new block must fit under the budget beside what is live and cached.
    evict_until(stats_.budget_bytes - stats_.live_bytes);
  }
  try {
    return data_of(system_block(n));
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.live_bytes -= n;
    stats_.system_bytes -= n;
    throw;
  }
}

void HostBlockCache::free(void* p) {
  if (p == nullptr) return;
  void* base = base_of(p);
  const int64_t n = static_cast<Header*>(base)->bytes;
  if (n >= options_.min_block_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.live_bytes -= n;
    if (stats_.cached_bytes + n <= options_.max_cached_bytes) {
      free_.emplace(n, base);
      stats_.cached_bytes += n;
      return;
    }
  }
  std::free(base);
}

void HostBlockCache::evict_until(int64_t footprint_limit) {
  while (stats_.cached_bytes > footprint_limit && !free_.empty()) {
    auto largest = std::prev(free_.end());
    std::free(largest->second);
    stats_.cached_bytes -= largest->first;
    ++stats_.evictions;
    free_.erase(largest);
  }
}

void HostBlockCache::release() {
  std::lock_guard<std::mutex> lock(mu_);
  evict_until(0);
}

void HostBlockCache::reset_budget() {
  std::lock_guard<std::mutex> lock(mu_);
  evict_until(0);
  stats_.budget_bytes = stats_.live_bytes;
}

void HostBlockCache::mark() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.marked_peak_bytes = stats_.live_bytes;
}

HostCacheStats HostBlockCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

namespace {

// c10 keeps a raw pointer to the registered allocator for the rest of the process, and
// tensors may be freed during static destruction: the one instance is never destroyed.
class CachingCpuAllocator final : public compat::AllocatorBase {
 public:
  explicit CachingCpuAllocator(HostCacheOptions options) : cache_(options) {}
  c10::DataPtr allocate_block(size_t n) const override {
    void* p = cache_.allocate(n);
    return {p, p, &release_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_block; }
  HostBlockCache& cache() const { return cache_; }

 private:
  static void release_block(void* p);
  mutable HostBlockCache cache_;
};

std::atomic<CachingCpuAllocator*>& installed() {
  static std::atomic<CachingCpuAllocator*> instance{nullptr};
  return instance;
}

void CachingCpuAllocator::release_block(void* p) {
  installed().load()->cache().free(p);
}

}  // namespace

HostBlockCache& install_caching_host_allocator(HostCacheOptions options) {
  static std::once_flag once;
  std::call_once(once, [&] {
    auto* a = new CachingCpuAllocator(options);
    installed().store(a);
    // Above LibTorch's own registration (0) and below the bench's tensor counter (100), which
    // wraps whatever allocator is current when it is installed.
    c10::SetCPUAllocator(a, /*priority=*/10);
  });
  return installed().load()->cache();
}

HostBlockCache* installed_host_cache() {
  auto* a = installed().load();
  return a != nullptr ? &a->cache() : nullptr;
}

void release_host_cache() {
  if (auto* c = installed_host_cache()) c->release();
}

void apply_host_allocator_choice(const std::string& choice) {
  HP_CHECK(choice == "caching" || choice == "system", "--host-allocator '", choice,
           "': expected caching (keep freed large blocks for reuse; the default) or system "
           "(LibTorch's own CPU allocator)");
  if (choice == "caching") install_caching_host_allocator();
}

}  // namespace hp::common
