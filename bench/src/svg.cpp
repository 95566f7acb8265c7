#include "hp/bench/svg.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

namespace hp::bench {
namespace {

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else if (c == '&') {
      out += "&amp;";
    } else {
      out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

const char* kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759",
                          "#76b7b2", "#edc948", "#b07aa1", "#9c755f"};

}  // namespace

std::string bar_chart_svg(const std::string& title, const std::vector<BarGroup>& groups) {
  double max_s = 0;
  size_t max_bars = 1;
  std::map<std::string, int> colour;
  for (const auto& g : groups) {
    max_bars = std::max(max_bars, g.bars.size());
    for (const auto& b : g.bars) {
      max_s = std::max(max_s, b.total_s);
      colour.emplace(b.label, static_cast<int>(colour.size()) % 8);
    }
  }
  if (max_s <= 0) max_s = 1;
  const double bar_w = 22, gap = 30, left = 60, top = 40, height = 260;
  const double group_w = static_cast<double>(max_bars) * bar_w + gap;
  const double width = left + static_cast<double>(groups.size()) * group_w + 220;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(width) << "\" height=\""
    << num(top + height + 90) << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  o << "<text x=\"" << num(left) << "\" y=\"20\" font-size=\"14\">" << esc(title) << "</text>\n";
  for (int t = 0; t <= 4; ++t) {  // y axis
    const double y = top + height - height * t / 4.0;
    o << "<line x1=\"" << num(left) << "\" x2=\"" << num(width - 220) << "\" y1=\"" << num(y)
      << "\" y2=\"" << num(y) << "\" stroke=\"#ddd\"/>\n";
    o << "<text x=\"" << num(left - 5) << "\" y=\"" << num(y + 4) << "\" text-anchor=\"end\">"
      << num(max_s * t / 4.0) << " s</text>\n";
  }
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const double x0 = left + static_cast<double>(gi) * group_w + gap / 2;
    for (size_t bi = 0; bi < groups[gi].bars.size(); ++bi) {
      const auto& b = groups[gi].bars[bi];
      const double x = x0 + static_cast<double>(bi) * bar_w;
      const double h = height * b.total_s / max_s;
      const double he = height * std::min(b.exposed_s, b.total_s) / max_s;
      o << "<rect x=\"" << num(x) << "\" y=\"" << num(top + height - h) << "\" width=\""
        << num(bar_w - 3) << "\" height=\"" << num(h) << "\" fill=\"" << kPalette[colour[b.label]]
        << "\"><title>" << esc(b.label) << ": " << b.total_s << " s, exposed comm " << b.exposed_s
        << " s</title></rect>\n";
      o << "<rect x=\"" << num(x) << "\" y=\"" << num(top + height - h) << "\" width=\""
        << num(bar_w - 3) << "\" height=\"" << num(he)
        << "\" fill=\"black\" fill-opacity=\"0.35\"/>\n";
    }
    o << "<text x=\"" << num(x0) << "\" y=\"" << num(top + height + 16) << "\">"
      << esc(groups[gi].title) << "</text>\n";
  }
  double ly = top;
  for (const auto& [label, c] : colour) {
    o << "<rect x=\"" << num(width - 200) << "\" y=\"" << num(ly) << "\" width=\"12\" "
      << "height=\"12\" fill=\"" << kPalette[c] << "\"/><text x=\"" << num(width - 182) << "\" y=\""
      << num(ly + 10) << "\">" << esc(label) << "</text>\n";
    ly += 18;
  }
  o << "<rect x=\"" << num(width - 200) << "\" y=\"" << num(ly) << "\" width=\"12\" height=\"12\" "
    << "fill=\"black\" fill-opacity=\"0.35\"/><text x=\"" << num(width - 182) << "\" y=\""
    << num(ly + 10) << "\">exposed communication</text>\n";
  o << "</svg>\n";
  return o.str();
}

std::string timeline_svg(const std::string& title, const std::vector<common::TraceEvent>& events,
                         int64_t begin_us, int64_t end_us) {
  int ranks = 0;
  for (const auto& e : events)
    ranks = std::max(ranks, e.rank + 1);
  const double left = 70, top = 40, track = 34, width = 1100;
  const double span = static_cast<double>(std::max<int64_t>(1, end_us - begin_us));
  auto x_of = [&](int64_t t) {
    return left + (width - left - 20) *
                      static_cast<double>(std::clamp(t, begin_us, end_us) - begin_us) / span;
  };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(width) << "\" height=\""
    << num(top + track * ranks + 60) << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  o << "<text x=\"" << num(left) << "\" y=\"20\" font-size=\"14\">" << esc(title) << "</text>\n";
  for (int r = 0; r < ranks; ++r) {
    const double y = top + track * r;
    o << "<text x=\"5\" y=\"" << num(y + 18) << "\">rank " << r << "</text>\n";
    o << "<rect x=\"" << num(left) << "\" y=\"" << num(y) << "\" width=\"" << num(width - left - 20)
      << "\" height=\"" << num(track - 6) << "\" fill=\"#f3f3f3\"/>\n";
  }
  // Three lanes per track: collectives in flight, compute (attention calls and their backward),
  // waits.
  const double lane = (track - 6) / 3;
  for (const auto& e : events) {
    if (e.end_us < begin_us || e.begin_us > end_us) continue;
    const int kind = e.category == "comm_wait" ? 2 : e.category == "compute" ? 1 : 0;
    static const char* const kFill[] = {"#4e79a7", "#59a14f", "#e15759"};
    const double y = top + track * e.rank + lane * kind;
    const double x = x_of(e.begin_us);
    const double w = std::max(1.0, x_of(e.end_us) - x);
    o << "<rect x=\"" << num(x) << "\" y=\"" << num(y) << "\" width=\"" << num(w) << "\" height=\""
      << num(lane) << "\" fill=\"" << kFill[kind] << "\"><title>" << esc(e.name) << " "
      << esc(e.group) << " " << (e.end_us - e.begin_us) / 1000.0 << " ms</title></rect>\n";
  }
  const double ly = top + track * ranks + 15;
  const char* const kLegend[][2] = {{"#4e79a7", "collective in flight (issue to completion)"},
                                    {"#59a14f", "attention (forward or backward)"},
                                    {"#e15759", "rank blocked waiting (exposed communication)"}};
  for (int i = 0; i < 3; ++i) {
    const double lx = left + 340 * i;
    o << "<rect x=\"" << num(lx) << "\" y=\"" << num(ly) << "\" width=\"12\" height=\"12\" "
      << "fill=\"" << kLegend[i][0] << "\"/><text x=\"" << num(lx + 16) << "\" y=\"" << num(ly + 10)
      << "\">" << kLegend[i][1] << "</text>\n";
  }
  o << "<text x=\"" << num(left) << "\" y=\"" << num(ly + 32) << "\">" << num(span / 1000.0)
    << " ms shown</text>\n</svg>\n";
  return o.str();
}

}  // namespace hp::bench
