// The tools' JSON result lines, as the tool tests read them.
#pragma once

#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace hp::testing {

// The last line of `out` that starts with '{', parsed (a tool's --json result follows its logs).
inline nlohmann::json last_json(const std::string& out) {
  std::istringstream lines(out);
  std::string line, last;
  while (std::getline(lines, line)) {
    if (!line.empty() && line[0] == '{') last = line;
  }
  return nlohmann::json::parse(last);
}

}  // namespace hp::testing
