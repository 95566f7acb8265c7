// Shapes in messages: "[2,4,8]".
#pragma once

#include <string>

#include <c10/util/ArrayRef.h>

namespace hp::common {

std::string shape_str(c10::IntArrayRef shape);

}  // namespace hp::common
