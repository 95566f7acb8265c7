#include "hp/comm/traffic.h"

#include <sstream>

#include "hp/common/check.h"

namespace hp::comm {

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
    case OpKind::kBarrier:
      return "barrier";
  }
  return "unknown";
}

int64_t theory_bytes_per_rank(OpKind op, int64_t bytes_in, int group_size) {
  HP_CHECK(group_size >= 1, "theory_bytes_per_rank: group_size=", group_size, " must be >= 1");
  const int64_t p = group_size;
  switch (op) {
    case OpKind::kAllGather:
      return (p - 1) * bytes_in;
    case OpKind::kReduceScatter:
    case OpKind::kAllToAll:
      return bytes_in * (p - 1) / p;
    case OpKind::kAllReduce:
      return 2 * bytes_in * (p - 1) / p;
    case OpKind::kSend:
      return p > 1 ? bytes_in : 0;
    case OpKind::kRecv:
    case OpKind::kBarrier:
      return 0;
  }
  return 0;
}

void TrafficCounters::add(OpKind op, const std::string& group, int64_t bytes_sent,
                          int64_t bytes_formula) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& e = entries_[{op, group}];
  e.bytes_sent += bytes_sent;
  e.bytes_formula += bytes_formula;
  e.calls += 1;
}

void TrafficCounters::add_wait(OpKind op, const std::string& group, int64_t wait_us) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_[{op, group}].wait_us += wait_us;
}

void TrafficCounters::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
}

int64_t TrafficCounters::bytes(OpKind op) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [key, e] : entries_) {
    if (key.first == op) total += e.bytes_sent;
  }
  return total;
}

int64_t TrafficCounters::bytes(OpKind op, const std::string& group) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find({op, group});
  return it == entries_.end() ? 0 : it->second.bytes_sent;
}

int64_t TrafficCounters::formula_bytes(OpKind op) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [key, e] : entries_) {
    if (key.first == op) total += e.bytes_formula;
  }
  return total;
}

int64_t TrafficCounters::formula_bytes(OpKind op, const std::string& group) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find({op, group});
  return it == entries_.end() ? 0 : it->second.bytes_formula;
}

int64_t TrafficCounters::total_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [key, e] : entries_)
    total += e.bytes_sent;
  return total;
}

int64_t TrafficCounters::calls(OpKind op) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [key, e] : entries_) {
    if (key.first == op) total += e.calls;
  }
  return total;
}

int64_t TrafficCounters::wait_us() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [key, e] : entries_)
    total += e.wait_us;
  return total;
}

std::map<std::pair<OpKind, std::string>, TrafficEntry> TrafficCounters::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_;
}

void TrafficCounters::restore(std::map<std::pair<OpKind, std::string>, TrafficEntry> entries) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_ = std::move(entries);
}

std::string CollectiveRecord::to_string() const {
  std::ostringstream out;
  out << op_name(op) << "(" << group;
  if (peer >= 0) out << ",peer=" << peer;
  out << ")";
  for (const auto& shape : shapes) {
    out << "[";
    for (size_t i = 0; i < shape.size(); ++i)
      out << (i ? "," : "") << shape[i];
    out << "]";
  }
  return out.str();
}

void CollectiveRecorder::record(CollectiveRecord record) {
  std::lock_guard<std::mutex> lock(mu_);
  records_.push_back(std::move(record));
}

std::vector<CollectiveRecord> CollectiveRecorder::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

std::vector<std::string> CollectiveRecorder::schedule() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.reserve(records_.size());
  for (const auto& r : records_)
    out.push_back(r.to_string());
  return out;
}

void CollectiveRecorder::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  records_.clear();
}

}  // namespace hp::comm
