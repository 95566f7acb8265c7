#include "hp/common/host_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <vector>

#include <c10/core/CPUAllocator.h>

#include "hp/common/check.h"
#include "hp/common/torch_compat.h"

namespace hp::common {
namespace {

// A block from the system allocator (small, or the arena could not serve it) starts with a
// header line holding its byte size; the caller's data follows it, so the data keeps the base's
// 64-byte alignment.
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
  HP_CHECK(options_.max_resident_over_peak >= 1.0,
           "HostCacheOptions.max_resident_over_peak = ", options_.max_resident_over_peak,
           ": must be at least 1 (live bytes alone reach the peak)");
  HP_CHECK(options_.arena_bytes >= 0, "HostCacheOptions.arena_bytes = ", options_.arena_bytes,
           ": must be at least 0 (0: the machine's physical memory)");
  const long page = sysconf(_SC_PAGESIZE);
  if (page > 0) page_ = page;
}

HostBlockCache::~HostBlockCache() {
  if (base_ != nullptr && live_.empty()) munmap(base_, static_cast<size_t>(reserved_));
}

bool HostBlockCache::reserve() {
  if (reserved_ != 0) return reserved_ > 0;
  int64_t want = options_.arena_bytes;
  if (want == 0) {
    const long pages = sysconf(_SC_PHYS_PAGES);
    want = pages > 0 ? static_cast<int64_t>(pages) * page_ : int64_t(64) << 30;
  }
  want = (want + page_ - 1) / page_ * page_;
  // Address space only: no access, no commit charge until a part is made writable.
  void* p = mmap(nullptr, static_cast<size_t>(want), PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    reserved_ = -1;
    return false;
  }
  base_ = static_cast<char*>(p);
  reserved_ = want;
  arena_hi_.store(reinterpret_cast<uintptr_t>(base_) + static_cast<uintptr_t>(want));
  arena_lo_.store(reinterpret_cast<uintptr_t>(base_));
  return true;
}

void HostBlockCache::insert_free(int64_t off, int64_t size) {
  free_by_addr_.emplace(off, size);
  free_by_size_.emplace(size, off);
  free_bytes_ += size;
}

void HostBlockCache::erase_free(std::map<int64_t, int64_t>::iterator it) {
  auto [lo, hi] = free_by_size_.equal_range(it->second);
  for (auto s = lo; s != hi; ++s) {
    if (s->second == it->first) {
      free_by_size_.erase(s);
      break;
    }
  }
  free_bytes_ -= it->second;
  free_by_addr_.erase(it);
}

int64_t HostBlockCache::take_cold(int64_t off, int64_t size) {
  const int64_t end = off + size;
  std::vector<std::pair<int64_t, int64_t>> hit;
  auto it = cold_.upper_bound(off);
  if (it != cold_.begin()) --it;
  for (; it != cold_.end() && it->first < end; ++it) {
    if (it->first + it->second > off) hit.emplace_back(*it);
  }
  int64_t taken = 0;
  for (const auto& [a, n] : hit) {
    cold_.erase(a);
    const int64_t lo = std::max(a, off), hi = std::min(a + n, end);
    taken += hi - lo;
    if (a < lo) cold_.emplace(a, lo - a);
    if (a + n > hi) cold_.emplace(hi, a + n - hi);
  }
  cold_bytes_ -= taken;
  return taken;
}

void HostBlockCache::give_back(int64_t off, int64_t size) {
  if (take_cold(off, size) == size) {  // nothing resident in it
    cold_.emplace(off, size);
    cold_bytes_ += size;
    return;
  }
  madvise(base_ + off, static_cast<size_t>(size), MADV_DONTNEED);
  cold_.emplace(off, size);
  cold_bytes_ += size;
  ++stats_.evictions;
}

void HostBlockCache::enforce_resident_bound() {
  const double limit = options_.max_resident_over_peak * static_cast<double>(stats_.budget_bytes);
  // Resident bytes over either bound, in whole pages (0: within both).
  auto excess = [&] {
    const double over = static_cast<double>(stats_.live_bytes + cached()) - limit;
    const int64_t by_peak = over > 0 ? static_cast<int64_t>(std::ceil(over)) : 0;
    const int64_t e = std::max(by_peak, cached() - options_.max_cached_bytes);
    return e > 0 ? (e + page_ - 1) / page_ * page_ : int64_t(0);
  };
  // Largest free ranges first, each once, and of each only as much of its tail as the bounds
  // need: a range given back whole is faulted in again whole by the next step that takes it,
  // where a step that overshoots the bound by a little then faults in only that little
  // (allocations take the front of a range).
  for (auto it = free_by_size_.rbegin(); it != free_by_size_.rend(); ++it) {
    const int64_t size = it->first, off = it->second;
    for (int64_t n = 0, need = excess(); need > 0 && n < size; need = excess()) {
      n = std::min(size, n + need);  // a tail already cold frees nothing: take more of it
      give_back(off + size - n, n);
    }
    if (excess() == 0) break;
  }
}

int64_t HostBlockCache::arena_allocate(int64_t r) {
  if (!reserve()) return -1;
  int64_t off = -1, fresh = 0;
  auto fit = free_by_size_.lower_bound(r);
  if (fit != free_by_size_.end()) {
    const int64_t size = fit->first;
    off = fit->second;
    erase_free(free_by_addr_.find(off));
    if (size > r) insert_free(off + r, size - r);
  } else {
    // Grow at the end, starting inside a free range that ends there.
    int64_t start = top_;
    if (!free_by_addr_.empty()) {
      auto last = std::prev(free_by_addr_.end());
      if (last->first + last->second == top_) start = last->first;
    }
    const int64_t grow = start + r - top_;
    if (start + r > reserved_ ||
        mprotect(base_ + top_, static_cast<size_t>(grow), PROT_READ | PROT_WRITE) != 0) {
      return -1;
    }
    if (start < top_) erase_free(free_by_addr_.find(start));
    top_ += grow;
    off = start;
    fresh = grow;
  }
  fresh += take_cold(off, r);
  stats_.system_bytes += fresh;
  ++(fresh > 0 ? stats_.misses : stats_.hits);
  live_.emplace(off, r);
  return off;
}

void* HostBlockCache::allocate(size_t bytes) {
  const auto n = static_cast<int64_t>(bytes);
  if (n < options_.min_block_bytes) return data_of(system_block(n));
  const int64_t r = (n + page_ - 1) / page_ * page_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t off = arena_allocate(r);
    if (off >= 0) {
      stats_.live_bytes += r;
      stats_.budget_bytes = std::max(stats_.budget_bytes, stats_.live_bytes);
      stats_.marked_peak_bytes = std::max(stats_.marked_peak_bytes, stats_.live_bytes);
      enforce_resident_bound();
      return base_ + off;
    }
    // The system's block, counted like the arena's.
    stats_.live_bytes += n;
    stats_.budget_bytes = std::max(stats_.budget_bytes, stats_.live_bytes);
    stats_.marked_peak_bytes = std::max(stats_.marked_peak_bytes, stats_.live_bytes);
    stats_.system_bytes += n;
    ++stats_.misses;
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
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a >= arena_lo_.load() && a < arena_hi_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(static_cast<char*>(p) - base_);
    HP_INTERNAL_ASSERT(it != live_.end(), "HostBlockCache::free: not a live block of this cache");
    int64_t off = it->first, size = it->second;
    live_.erase(it);
    stats_.live_bytes -= size;
    // Merge with the free neighbours.
    auto next = free_by_addr_.find(off + size);
    if (next != free_by_addr_.end()) {
      size += next->second;
      erase_free(next);
    }
    auto prev = free_by_addr_.lower_bound(off);
    if (prev != free_by_addr_.begin()) {
      --prev;
      if (prev->first + prev->second == off) {
        off = prev->first;
        size += prev->second;
        erase_free(prev);
      }
    }
    insert_free(off, size);
    enforce_resident_bound();  // (only the cap can be crossed here: live + cached is unchanged)
    return;
  }
  void* base = base_of(p);
  const int64_t n = static_cast<Header*>(base)->bytes;
  if (n >= options_.min_block_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.live_bytes -= n;
  }
  std::free(base);
}

void HostBlockCache::release() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [off, size] : free_by_addr_)
    give_back(off, size);
  // The arena's free end is uncommitted again.
  if (!free_by_addr_.empty()) {
    auto last = std::prev(free_by_addr_.end());
    if (last->first + last->second == top_) {
      const int64_t off = last->first;
      mprotect(base_ + off, static_cast<size_t>(top_ - off), PROT_NONE);
      take_cold(off, top_ - off);
      erase_free(last);
      top_ = off;
    }
  }
}

void HostBlockCache::reset_budget() {
  release();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.budget_bytes = stats_.live_bytes;
}

void HostBlockCache::mark() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.marked_peak_bytes = stats_.live_bytes;
}

HostCacheStats HostBlockCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostCacheStats s = stats_;
  s.cached_bytes = cached();
  s.arena_bytes = top_;
  return s;
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
