#include "hp/bench/tensor_bytes.h"

#include <atomic>
#include <mutex>

#include <c10/core/CPUAllocator.h>

#include "hp/common/torch_compat.h"

namespace hp::bench::tensor_bytes {
namespace {

// The counters live in the one allocator object (a function-local static): c10 holds a raw
// pointer to it for the rest of the process.
class CountingAllocator final : public compat::AllocatorBase {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate_block(size_t n) const override {
    auto inner = inner_->allocate(n);
    void* data = inner.get();
    auto* ctx = new Held{std::move(inner), static_cast<int64_t>(n), this};
    const int64_t now = current_.fetch_add(ctx->bytes) + ctx->bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return {data, ctx, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() const { peak_.store(current_.load()); }

 private:
  struct Held {
    c10::DataPtr inner;  // frees the storage through the wrapped allocator's deleter
    int64_t bytes;
    const CountingAllocator* owner;
  };
  static void release(void* p) {
    auto* h = static_cast<Held*>(p);
    h->owner->current_.fetch_sub(h->bytes);
    delete h;
  }

  c10::Allocator* inner_;
  mutable std::atomic<int64_t> current_{0}, peak_{0};
};

CountingAllocator* instance(bool create) {
  static std::once_flag once;
  static CountingAllocator* counting = nullptr;
  if (create) {
    std::call_once(once, [] {
      counting = new CountingAllocator(c10::GetCPUAllocator());
      // Priority above the default registrations, so tensors made from here on use it.
      c10::SetCPUAllocator(counting, /*priority=*/100);
    });
  }
  return counting;
}

}  // namespace

bool install() {
  auto* c = instance(true);
  return c10::GetCPUAllocator() == c;
}
bool installed() {
  auto* c = instance(false);
  return c != nullptr && c10::GetCPUAllocator() == c;
}
int64_t current() {
  auto* c = instance(false);
  return c ? c->current() : 0;
}
int64_t peak() {
  auto* c = instance(false);
  return c ? c->peak() : 0;
}
void reset_peak() {
  if (auto* c = instance(false)) c->reset_peak();
}

}  // namespace hp::bench::tensor_bytes
