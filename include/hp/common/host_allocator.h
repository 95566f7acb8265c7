// A cache of freed host (CPU) memory for LibTorch's CPU allocator.
//
// Why: glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mmap
// and unmaps it on free, so every step of a long-context layer (q, k, v, out and their
// gradients: 32 MiB each at S = 16384, H = 8, D = 64, fp32) faults every page of every large
// tensor in again; on a VM whose page faults trap to the hypervisor that was 8-10% of a step.
//
// How: blocks of at least `min_block_bytes` are carved from one arena, an address range
// reserved without memory and committed as it grows. An allocation takes the best-fitting free
// range (the smallest that holds it; split, the rest stays free); a freed block merges with its
// free neighbours. Freed ranges keep their pages, so a step that repeats the last one's
// allocations faults nothing in. (An earlier version reused a freed block only for a request of
// exactly its size, under a footprint of at most the peak live total: a CP layer's step then
// still took 300-450 MiB of fresh pages from the system per rank, as sizes of 8, 16, 24 and 32
// MiB crowded each other out.)
//
// Contract:
// - Sizes are rounded up to whole pages; every block is at least 64-byte aligned (as LibTorch's
//   own CPU allocator). Blocks below `min_block_bytes` go straight to the system allocator.
// - The arena grows only when no free range holds the request, and then by at most the request
//   (a free range at its end is used). What stays resident, live + cached bytes, is at most
//   `max_resident_over_peak` x the largest live total since the last reset_budget(): beyond it,
//   free ranges give their pages back (largest first, and of each only the tail the bound
//   needs, whole pages; a later reuse faults them in again). A step that overshoots the bound by
//   a little then faults in only that little: giving back whole ranges cost a CP layer that
//   alternated two layouts 40-156 MiB of fresh pages per step and rank at 1.28x.
//   Cached (resident free) bytes also stay at or below `max_cached_bytes`.
// - If the arena cannot be reserved or is full, or the system refuses to commit more, the
//   block comes from the system allocator (a miss); throws std::bad_alloc when that fails too.
// - Thread-safe. release() gives every free range's pages back and shrinks the arena to its
//   last live block.
//
// install_caching_host_allocator() registers one process-wide cache with c10 (tensors created
// from then on use it; earlier tensors keep their own deleters). Tools call it first thing in
// main (hp-train, hp-bench, hp-cp-run; `--host-allocator system` opts out); library code never
// does, so a host program keeps the allocator it chose.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace hp::common {

struct HostCacheOptions {
  int64_t min_block_bytes = int64_t(1) << 20;   // smaller blocks are not cached
  int64_t max_cached_bytes = int64_t(8) << 30;  // resident free bytes at most
  // Live + cached bytes at most this multiple of the peak live total (since reset_budget()).
  // Best fit over a step of a CP layer needed 1.15-1.2x to fault nothing in after warm-up.
  double max_resident_over_peak = 1.25;
  int64_t arena_bytes = 0;  // address range to reserve; 0: the machine's physical memory
};

struct HostCacheStats {
  int64_t live_bytes = 0;         // handed out and not yet freed (cached-size blocks, whole pages)
  int64_t cached_bytes = 0;       // freed and still resident, kept for reuse
  int64_t arena_bytes = 0;        // the arena's committed part: live + free ranges
  int64_t budget_bytes = 0;       // largest live total since the last reset_budget()
  int64_t marked_peak_bytes = 0;  // largest live total since the last mark()
  int64_t system_bytes = 0;       // bytes of cacheable blocks with fresh pages from the system
  int64_t hits = 0;               // served from resident free ranges
  int64_t misses = 0;     // needed fresh pages (arena growth, given-back pages, system blocks)
  int64_t evictions = 0;  // free ranges whose pages were given back
};

class HostBlockCache {
 public:
  explicit HostBlockCache(HostCacheOptions options = {});
  ~HostBlockCache();  // unmaps the arena unless blocks are still live (they belong to owners)
  HostBlockCache(const HostBlockCache&) = delete;
  HostBlockCache& operator=(const HostBlockCache&) = delete;

  // `bytes` (0 allowed) 64-byte aligned; throws std::bad_alloc when the system has none.
  void* allocate(size_t bytes);
  // A pointer from allocate() of this cache (nullptr is ignored).
  void free(void* p);
  // Gives every free range's pages back to the system; the arena shrinks to its last live block.
  void release();
  // release(), and the peak the resident bound refers to restarts at the bytes live now.
  void reset_budget();
  // marked_peak_bytes restarts at the bytes live now (a step's own peak: marked_peak_bytes
  // after it minus live_bytes at the mark).
  void mark();
  HostCacheStats stats() const;
  const HostCacheOptions& options() const { return options_; }

 private:
  // All below: the caller holds mu_. Offsets are from base_.
  bool reserve();
  int64_t arena_allocate(int64_t r);  // -1: the arena cannot serve it
  void insert_free(int64_t off, int64_t size);
  void erase_free(std::map<int64_t, int64_t>::iterator it);
  int64_t take_cold(int64_t off, int64_t size);  // bytes of [off, off+size) without pages
  void give_back(int64_t off, int64_t size);     // madvise away; the range becomes cold
  void enforce_resident_bound();
  int64_t cached() const { return free_bytes_ - cold_bytes_; }

  HostCacheOptions options_;
  int64_t page_ = 4096;
  mutable std::mutex mu_;
  char* base_ = nullptr;
  int64_t reserved_ = 0;  // 0: not yet; -1: reservation failed
  // [base_, base_ + reserved_) once reserved, for free() to tell arena blocks without the lock.
  std::atomic<uintptr_t> arena_lo_{0}, arena_hi_{0};
  int64_t top_ = 0;                               // committed bytes from base_
  std::map<int64_t, int64_t> free_by_addr_;       // offset -> size (merged: never adjacent)
  std::multimap<int64_t, int64_t> free_by_size_;  // size -> offset
  std::map<int64_t, int64_t> cold_;               // free sub-ranges whose pages were given back
  std::map<int64_t, int64_t> live_;               // offset -> size
  int64_t free_bytes_ = 0, cold_bytes_ = 0;
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
    "caching (default: freed large CPU blocks are reused, at most 1.25x the peak) | system "
    "(LibTorch's allocator)";
inline const std::vector<std::string>& host_allocator_choices() {
  static const std::vector<std::string> kChoices{"caching", "system"};
  return kChoices;
}
// What a tool appends to the command lines of the children it measures with, so they run under
// its choice: " --host-allocator CHOICE", or nothing for the default (caching).
inline std::string host_allocator_flag(const std::string& choice) {
  return choice == host_allocator_choices().front() ? std::string() : " --host-allocator " + choice;
}

}  // namespace hp::common
