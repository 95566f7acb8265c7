// Small SVG pictures for the benchmark report (no dependencies; plain text output).
#pragma once

#include <string>
#include <vector>

#include "hp/common/trace.h"

namespace hp::bench {

struct Bar {
  std::string label;     // e.g. "ulysses/async"
  double total_s = 0;    // bar height
  double exposed_s = 0;  // shaded top part (exposed communication)
};

struct BarGroup {
  std::string title;  // e.g. "P=2 S=16384 (1gbit)"
  std::vector<Bar> bars;
};

// Grouped bar chart: step time per choice, exposed communication shaded.
std::string bar_chart_svg(const std::string& title, const std::vector<BarGroup>& groups);

// One track per rank over [begin_us, end_us], in three lanes of coloured boxes: collectives in
// flight, compute events (attention calls and their backward), waits.
std::string timeline_svg(const std::string& title, const std::vector<common::TraceEvent>& events,
                         int64_t begin_us, int64_t end_us);

}  // namespace hp::bench
