// What the comm layer observed: bytes per op kind and group, the issued schedule, the timeline.
//
// A CommContext belongs to one World (no globals); every Group of that World reports into it.
// All classes here are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hp/comm/types.h"

namespace hp::common {
class Tracer;
}

namespace hp::comm {

struct TrafficEntry {
  int64_t bytes_sent = 0;     // counted: bytes of the tensors handed to the backend for peers
  int64_t bytes_formula = 0;  // the op's formula (theory_bytes_per_rank), summed per call
  int64_t calls = 0;
  int64_t wait_us = 0;  // time this rank spent blocked in CommHandle::wait
};

// Bytes sent per rank, per (op kind, group), counted from the tensors and, separately, by
// formula (benches and tests compare the two). Resettable.
class TrafficCounters {
 public:
  void add(OpKind op, const std::string& group, int64_t bytes_sent, int64_t bytes_formula);
  void add_wait(OpKind op, const std::string& group, int64_t wait_us);
  void reset();

  int64_t bytes(OpKind op) const;  // counted, summed over groups
  int64_t bytes(OpKind op, const std::string& group) const;
  int64_t total_bytes() const;
  int64_t formula_bytes(OpKind op) const;  // the formula, summed over groups
  int64_t formula_bytes(OpKind op, const std::string& group) const;
  int64_t calls(OpKind op) const;
  int64_t wait_us() const;  // summed over everything
  std::map<std::pair<OpKind, std::string>, TrafficEntry> snapshot() const;
  // Back to a snapshot: traffic that is not the workload's (a check's own collectives) is not
  // counted. Only while no other collective of this context is in flight.
  void restore(std::map<std::pair<OpKind, std::string>, TrafficEntry> entries);

 private:
  mutable std::mutex mu_;
  std::map<std::pair<OpKind, std::string>, TrafficEntry> entries_;
};

// One issued collective, as the recording group lists it.
struct CollectiveRecord {
  OpKind op;
  std::string group;
  std::vector<std::vector<int64_t>> shapes;  // input shapes as passed by the caller
  std::string dtype;
  int64_t bytes_sent = 0;
  int peer = -1;  // send/recv: peer rank in the group

  std::string to_string() const;  // "all_gather(cp)[2,4,8,16]"
};

// Lists the issued collectives so a test can assert the communication schedule itself.
class CollectiveRecorder {
 public:
  void record(CollectiveRecord record);
  std::vector<CollectiveRecord> records() const;
  std::vector<std::string> schedule() const;  // to_string() of each record, in issue order
  void clear();

 private:
  mutable std::mutex mu_;
  std::vector<CollectiveRecord> records_;
};

// Everything a World's groups report into.
struct CommContext {
  int world_rank = 0;
  // Collectives this process has launched, over all groups (the progress its heartbeat reports;
  // see WorldOptions::heartbeat_interval).
  std::atomic<int64_t> ops_launched{0};
  bool verify_shapes = false;  // exchange shapes before each collective (clear mismatch errors)
  TrafficCounters counters;
  std::shared_ptr<common::Tracer> tracer;        // may be null
  std::shared_ptr<CollectiveRecorder> recorder;  // may be null
  // Set by a World with a job store: which peers a failed collective lost (appended to the
  // CommError). Empty: no diagnosis.
  std::function<std::string()> diagnose_failure;
};

}  // namespace hp::comm
