#include "hp/common/trace.h"

#include <time.h>

#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "hp/common/check.h"

namespace hp::common {

void Tracer::record(TraceEvent event) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::move(event));
}

std::vector<TraceEvent> Tracer::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void Tracer::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
}

int64_t Tracer::now_us() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events) {
  nlohmann::json out;
  out["displayTimeUnit"] = "ms";
  auto& list = out["traceEvents"];
  list = nlohmann::json::array();
  std::map<int, bool> ranks;
  for (const auto& e : events) {
    ranks[e.rank] = true;
    nlohmann::json j = {{"name", e.name},
                        {"cat", e.category},
                        {"ph", "X"},
                        {"ts", e.begin_us},
                        {"dur", std::max<int64_t>(0, e.end_us - e.begin_us)},
                        {"pid", e.rank},
                        {"tid", e.category == "comm" ? 1 : 0}};
    nlohmann::json args = nlohmann::json::object();
    if (!e.group.empty()) args["group"] = e.group;
    if (e.bytes >= 0) args["bytes"] = e.bytes;
    j["args"] = args;
    list.push_back(std::move(j));
  }
  for (const auto& [rank, unused] : ranks) {
    list.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank},
                    {"args", {{"name", "rank " + std::to_string(rank)}}}});
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    HP_CHECK(f.good(), "write_chrome_trace: cannot open '", tmp,
             "' for writing; check that the directory exists and is writable");
    f << out.dump() << "\n";
  }
  HP_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "write_chrome_trace: cannot rename '", tmp,
           "' to '", path, "'");
}

std::vector<TraceEvent> read_chrome_trace(const std::string& path) {
  std::ifstream f(path);
  HP_CHECK(f.good(), "read_chrome_trace: cannot open '", path, "'");
  nlohmann::json in = nlohmann::json::parse(f);
  std::vector<TraceEvent> events;
  for (const auto& j : in.at("traceEvents")) {
    if (j.value("ph", "") != "X") continue;
    TraceEvent e;
    e.name = j.at("name");
    e.category = j.value("cat", "");
    e.rank = j.value("pid", 0);
    e.begin_us = j.value("ts", int64_t{0});
    e.end_us = e.begin_us + j.value("dur", int64_t{0});
    const auto& args = j.value("args", nlohmann::json::object());
    e.group = args.value("group", "");
    e.bytes = args.value("bytes", int64_t{-1});
    events.push_back(std::move(e));
  }
  return events;
}

}  // namespace hp::common
