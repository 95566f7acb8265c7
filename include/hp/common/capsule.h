// Carrying a C++ value through an autograd context (ctx->saved_data holds IValues only): the
// value is boxed into a capsule that keeps it alive as long as the graph node. For .cpp files
// that define torch::autograd::Function nodes.
#pragma once

#include <utility>

#include <ATen/core/ivalue.h>

namespace hp::common {

template <typename T>
struct CapsuleBox : torch::CustomClassHolder {
  explicit CapsuleBox(T v) : value(std::move(v)) {}
  T value;
};

template <typename T>
c10::IValue to_capsule(T value) {
  return c10::IValue::make_capsule(c10::make_intrusive<CapsuleBox<T>>(std::move(value)));
}

// The value boxed by to_capsule<T> (a copy: boxes hold handles such as shared_ptrs).
template <typename T>
T from_capsule(const c10::IValue& v) {
  auto holder = v.toCapsule();
  return static_cast<CapsuleBox<T>*>(holder.get())->value;
}

}  // namespace hp::common
