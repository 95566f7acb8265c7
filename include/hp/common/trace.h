// Chrome-trace timelines (chrome://tracing, Perfetto): one track per rank.
//
// A Tracer is an explicit object (no global): the comm layer records every collective into the
// Tracer its World was given, threads-as-ranks tests can share one Tracer between rank threads,
// and rank processes each write a part that rank 0 merges into one file per run.
// Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace hp::common {

struct TraceEvent {
  std::string name;      // e.g. "all_gather"
  std::string category;  // e.g. "comm", "comm_wait", "compute"
  int rank = 0;          // the track
  int64_t begin_us = 0;  // CLOCK_MONOTONIC microseconds (comparable across processes)
  int64_t end_us = 0;
  std::string group;   // process group name, empty for non-comm events
  int64_t bytes = -1;  // bytes sent by this rank, -1 when not applicable
};

class Tracer {
 public:
  explicit Tracer(bool enabled = true) : enabled_(enabled) {}

  bool enabled() const { return enabled_; }
  void record(TraceEvent event);
  std::vector<TraceEvent> events() const;
  void clear();

  // Monotonic clock in microseconds, shared by all processes on a machine.
  static int64_t now_us();

 private:
  bool enabled_;
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
};

// Writes events as Chrome trace JSON (`{"traceEvents": [...]}`), one process track per rank.
void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events);

// Reads back a file written by write_chrome_trace (for merging per-rank parts and for tests).
std::vector<TraceEvent> read_chrome_trace(const std::string& path);

}  // namespace hp::common
