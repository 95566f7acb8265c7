// A cache of freed host (CPU) memory blocks for LibTorch's CPU allocator.
//
// Why: glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mmap
// and unmaps it on free, so every step of a long-context layer (q, k, v, out and their
// gradients: 32 MiB each at S = 16384, H = 8, D = 64, fp32) faults every page of every large
// tensor in again: about 8% of a packed-documents step in one process (perf: page faults,
// memcg charging, unmaps). Freed large blocks are kept here by size and handed out again.
//
// Contract:
// - Blocks of at least `min_block_bytes` are cached on free and reused by an allocation of the
//   same byte size; smaller ones go straight to the system allocator.
// - The footprint never exceeds what the system allocator would need: live + cached bytes stay
//   at or below the largest live total since the last reset_budget() (a miss evicts cached
//   blocks until the new block fits under that mark), and cached bytes at or below
//   `max_cached_bytes`. A program's peak memory is therefore unchanged; only memory that would
//   have been returned to the kernel and faulted in again stays mapped.
// - Thread-safe; every block is 64-byte aligned (as LibTorch's own CPU allocator).
// - release() frees every cached block (before measuring memory, or to hand memory back).
//
// install_caching_host_allocator() registers one process-wide cache with c10 (tensors created
// from then on use it; earlier tensors keep their own deleters). Tools call it first thing in
// main (hp-train, hp-bench, hp-cp-run; `--host-allocator system` opts out); library code never
// does, so a host program keeps the allocator it chose.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace hp::common {

struct HostCacheOptions {
  int64_t min_block_bytes = int64_t(1) << 20;   // smaller blocks are not cached
  int64_t max_cached_bytes = int64_t(8) << 30;  // cached (free) bytes at most
};

struct HostCacheStats {
  int64_t live_bytes = 0;         // handed out and not yet freed (cached-size blocks only)
  int64_t cached_bytes = 0;       // freed, kept for reuse
  int64_t budget_bytes = 0;       // largest live total since the last reset_budget()
  int64_t marked_peak_bytes = 0;  // largest live total since the last mark()
  int64_t system_bytes = 0;       // bytes of cacheable blocks taken from the system, in all
  int64_t hits = 0, misses = 0, evictions = 0;
};

class HostBlockCache {
 public:
  explicit HostBlockCache(HostCacheOptions options = {});
  ~HostBlockCache();  // frees the cached blocks (live ones belong to their owners)
  HostBlockCache(const HostBlockCache&) = delete;
  HostBlockCache& operator=(const HostBlockCache&) = delete;

  // `bytes` (0 allowed) 64-byte aligned; throws std::bad_alloc when the system has none.
  void* allocate(size_t bytes);
  // A pointer from allocate() of this cache (nullptr is ignored).
  void free(void* p);
  void release();
  // The footprint bound restarts at the bytes live now (cached blocks above it are freed).
  void reset_budget();
  // marked_peak_bytes restarts at the bytes live now (a step's own peak: marked_peak_bytes
  // after it minus live_bytes at the mark).
  void mark();
  HostCacheStats stats() const;
  const HostCacheOptions& options() const { return options_; }

 private:
  void evict_until(int64_t footprint_limit);  // caller holds mu_
  HostCacheOptions options_;
  mutable std::mutex mu_;
  std::multimap<int64_t, void*> free_;  // size -> block base
  HostCacheStats stats_;
};

// Registers a process-wide HostBlockCache as c10's CPU allocator (once; later calls return the
// same cache and ignore `options`). Returns it.
HostBlockCache& install_caching_host_allocator(HostCacheOptions options = {});
// The installed cache, or nullptr.
HostBlockCache* installed_host_cache();
// Frees the installed cache's blocks; no-op when none is installed.
void release_host_cache();

// `caching` (install) or `system` (leave LibTorch's allocator), from a tool's
// --host-allocator option; anything else is refused by name.
void apply_host_allocator_choice(const std::string& choice);
inline constexpr const char* kHostAllocatorHelp =
    "caching (default: freed large CPU blocks are reused, never above the peak) | system "
    "(LibTorch's allocator)";
inline const std::vector<std::string>& host_allocator_choices() {
  static const std::vector<std::string> kChoices{"caching", "system"};
  return kChoices;
}

}  // namespace hp::common
