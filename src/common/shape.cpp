#include "hp/common/shape.h"

namespace hp::common {

std::string shape_str(c10::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace hp::common
