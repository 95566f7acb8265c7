// Small string helpers the tools' messages share.
#pragma once

#include <string>
#include <vector>

namespace hp::common {

// `items` joined by `separator`, e.g. "--schedule async, --ring-keep-blocks".
inline std::string str_join(const std::vector<std::string>& items,
                            const std::string& separator = ", ") {
  std::string out;
  for (const auto& item : items)
    out += (out.empty() ? "" : separator) + item;
  return out;
}

}  // namespace hp::common
