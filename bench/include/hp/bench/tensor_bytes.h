// Live CPU tensor bytes: what the tensors of this process hold, counted at the allocator, not
// estimated. It complements the resident-set peak (StepPeak in cp_bench.cpp), which also sees
// the C allocator's caching and fragmentation and moves by tens of MiB between runs; the tensor
// count is exact at every moment (its peak moves only with when other threads, such as the
// communication's, free their tensors: by a few local tensors at most).
//
// install() wraps c10's CPU allocator once per process (c10 keeps one allocator registry per
// process, so this is process-wide by nature; call it before the tensors you want counted are
// made: storage allocated earlier is freed through its own deleter and never counted).
#pragma once

#include <cstdint>

namespace hp::bench::tensor_bytes {

// Wraps the CPU allocator (idempotent). False if another allocator with a higher priority
// was registered and ours would not be used.
bool install();
bool installed();
// Bytes of CPU tensor storage allocated through the wrapper and not yet freed.
int64_t current();
// The most current() has been since the last reset_peak() (reset_peak() sets it to current()).
int64_t peak();
void reset_peak();

}  // namespace hp::bench::tensor_bytes
