// Every LibTorch version difference hyperparallel depends on lives here (DESIGN section 2).
// Algorithms never test TORCH_VERSION themselves; they use the names below.
//
// Include only from .cpp files: it pulls in c10d headers.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace hp::compat {

#if TORCH_VERSION_MAJOR >= 2
// LibTorch 2.x: collectives live on c10d::Backend; ProcessGroupGloo derives from it.
using C10dBackend = c10d::Backend;
inline constexpr bool kHasSdpa = true;
#else
// LibTorch 1.x: ProcessGroupGloo derives from c10d::ProcessGroup directly.
using C10dBackend = c10d::ProcessGroup;
inline constexpr bool kHasSdpa = false;
#endif

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// c10::Allocator in LibTorch 2.3 gained a pure virtual copy_data and lost the const of
// allocate(). An allocator derives from this base and implements allocate_block(), which builds
// against both.
class AllocatorBase : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(size_t n) override {
    return allocate_block(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t n) const override {
    return allocate_block(n);
  }
#endif

 protected:
  virtual c10::DataPtr allocate_block(size_t n) const = 0;
};

// NCCL exists where LibTorch was built with it and the build defines USE_C10D_NCCL (CMake does
// when it finds LibTorch's CUDA libraries; HP_WITH_NCCL).
#if defined(USE_C10D_NCCL)
inline constexpr bool kHasNccl = true;
#else
inline constexpr bool kHasNccl = false;
#endif

// Whether the named c10d backend implements a native reduce-scatter that we trust.
// Gloo in 1.13 has none ("ProcessGroupGloo does not support reduce_scatter").
inline bool backend_has_native_reduce_scatter(const std::string& backend_name) {
  return backend_name == "nccl";
}

// Creates a Gloo backend over `store` bound to `hostname`, with `timeout` for every collective.
inline c10::intrusive_ptr<C10dBackend> make_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  options->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

// Creates a NCCL backend over `store` (tensors on CUDA devices); throws where there is none.
inline c10::intrusive_ptr<C10dBackend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
#if defined(USE_C10D_NCCL)
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  TORCH_CHECK(false, "this LibTorch was built without NCCL");
#endif
}

// at::scaled_dot_product_attention where it exists (LibTorch >= 2.1 takes `scale`); the
// registry only calls it when kHasSdpa.
inline at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& mask, double scale) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(
      q, k, v, mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt, 0.0, false, scale);
#else
  (void)q, (void)k, (void)v, (void)mask, (void)scale;
  TORCH_CHECK(false, "at::scaled_dot_product_attention needs LibTorch >= 2");
#endif
}

// The backend name ("gloo", "nccl", ...) of a process group made by someone else (e.g.
// torch.distributed): the one its transport reports.
// LibTorch 2.x: a group made with several backends (or none named) reports "undefined" or
// "cpu:gloo,cuda:nccl"; the name is then that of the backend behind its CPU (else CUDA) tensors.
inline std::string process_group_backend_name(c10d::ProcessGroup& pg) {
  std::string name = pg.getBackendName();
#if TORCH_VERSION_MAJOR >= 2
  if (name == "undefined" || name.find(':') != std::string::npos) {
    for (auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
      try {
        return pg.getBackend(device)->getBackendName();
      } catch (const std::exception&) {
      }
    }
  }
#endif
  return name;
}

// The Future a Work completes, when the backend provides one; nullptr otherwise.
inline c10::intrusive_ptr<c10::ivalue::Future> work_future(const WorkPtr& work) {
  try {
    return work->getFuture();
  } catch (const std::exception&) {
    return {};
  }
}

}  // namespace hp::compat
