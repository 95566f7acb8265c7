#include "tile_gemm.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "hp/attention/attention.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "parallel_units.h"
#include "tile_gemm_avx512.h"

namespace hp::attention::detail {
namespace {

// The Fortran BLAS interface (LP64: 32-bit integers), as ATen declares it.
template <typename T>
using FortranGemm = void (*)(const char*, const char*, const int*, const int*, const int*, const T*,
                             const T*, const int*, const T*, const int*, const T*, T*, const int*);

template <typename T>
FortranGemm<T> fortran_gemm() {
  // Looked up once: the symbol LibTorch's own GEMMs bind to (global scope), or none.
  static const FortranGemm<T> fn = reinterpret_cast<FortranGemm<T>>(
      dlsym(RTLD_DEFAULT, sizeof(T) == sizeof(float) ? "sgemm_" : "dgemm_"));
  return fn;
}

// A row-major [rows x cols] matrix with leading dim ld, as a tensor over the same memory.
template <typename T>
at::Tensor view_of(const T* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

template <typename T>
void aten_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

template <typename T>
void gemm_impl(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (auto fn = fortran_gemm<T>()) {
    constexpr int64_t kMax = std::numeric_limits<int>::max();
    HP_INTERNAL_ASSERT(
        m <= kMax && n <= kMax && k <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax,
        "tile gemm: a dimension beyond the 32-bit BLAS interface");
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap.
    const char tra = tb ? 'T' : 'N', trb = ta ? 'T' : 'N';
    const int mm = static_cast<int>(n), nn = static_cast<int>(m), kk = static_cast<int>(k);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    fn(&tra, &trb, &mm, &nn, &kk, &alpha, b, &la, a, &lb, &beta, c, &lc);
    return;
  }
  aten_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <typename T>
void aten_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  auto av = ta ? view_of(a, k, m, lda).t() : view_of(a, m, k, lda);
  auto bv = tb ? view_of(b, n, k, ldb).t() : view_of(b, k, n, ldb);
  auto cv = view_of(c, m, n, ldc);
  at::addmm_out(cv, cv, av, bv, beta, alpha);  // beta = 0: cv's contents are ignored
}

}  // namespace

TileGemmPath float_tile_gemm_path() {
  // Read once: the environment is the process's, and the choice must not change mid-run.
  static const TileGemmPath path = [] {
    const char* env = std::getenv("HP_TILE_GEMM");
    const bool want_blas = env != nullptr && std::strcmp(env, "blas") == 0;
    HP_CHECK(env == nullptr || *env == '\0' || want_blas || std::strcmp(env, "auto") == 0,
             "HP_TILE_GEMM='", env, "' is not a tile GEMM path; use auto (the default: the ",
             "AVX-512 kernel where the CPU has it, else BLAS) or blas");
    return !want_blas && avx512_gemm_supported() ? TileGemmPath::kAvx512 : TileGemmPath::kBlas;
  }();
  return path;
}

const char* tile_gemm_path_name(TileGemmPath path) {
  return path == TileGemmPath::kAvx512 ? "avx512" : "blas";
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (float_tile_gemm_path() == TileGemmPath::kAvx512 && (!tb || k <= kAvx512GemmMaxPackedK)) {
    gemm_avx512(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  gemm_impl<float>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <typename T>
void SharedBt<T>::reset(const T* b, int64_t ldb, int64_t n, int64_t k) {
  b_ = b;
  ldb_ = ldb;
  n_ = n;
  k_ = k;
  packed_ = false;
  if constexpr (std::is_same_v<T, float>) {
    if (float_tile_gemm_path() == TileGemmPath::kAvx512 && k <= kAvx512GemmMaxPackedK) {
      panels_.resize(static_cast<size_t>(avx512_panels_size(n, k)));
      pack_transposed_panels(b, ldb, n, k, panels_.data());
      packed_ = true;
    }
  }
}

template <typename T>
void SharedBt<T>::gemm(int64_t m, int64_t n_used, T alpha, const T* a, int64_t lda, T beta, T* c,
                       int64_t ldc) const {
  HP_INTERNAL_ASSERT(n_used <= n_, "SharedBt: ", n_used, " columns asked of ", n_);
  if constexpr (std::is_same_v<T, float>) {
    if (packed_) {
      gemm_avx512_nt_packed(m, n_used, k_, alpha, a, lda, panels_.data(), beta, c, ldc);
      return;
    }
  }
  detail::gemm(false, true, m, n_used, k_, alpha, a, lda, b_, ldb_, beta, c, ldc);
}

template class SharedBt<float>;
template class SharedBt<double>;

void gemm_via_blas(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_impl<float>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm_impl<double>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm_via_aten(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                   int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  aten_gemm<double>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace hp::attention::detail

namespace hp::attention {

std::string blockwise_tile_gemm_path() {
  return detail::tile_gemm_path_name(detail::float_tile_gemm_path());
}

double blockwise_tile_gemm_gflops(int reps) {
  HP_CHECK(reps >= 1, "blockwise_tile_gemm_gflops: reps=", reps, " must be >= 1");
  constexpr int64_t kRows = 256, kCols = 256, kDepth = 64;
  const int threads = at::get_num_threads();
  detail::warm_blas_buffers(threads);
  common::ScopedBlasThreads one_blas_thread(1);
  std::vector<std::vector<float>> q(threads), k(threads), s(threads);
  for (int t = 0; t < threads; ++t) {
    q[t].assign(kRows * kDepth, 0.5f);
    k[t].assign(kCols * kDepth, 0.25f);
    s[t].assign(kRows * kCols, 0.0f);
  }
  std::vector<double> rounds;
  for (int round = 0; round < 6; ++round) {  // the first is a warm-up
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int r = 0; r < reps; ++r) {
          detail::gemm(false, true, kRows, kCols, kDepth, 0.125f, q[t].data(), kDepth,
                       k[t].data(), kDepth, 0.0f, s[t].data(), kCols);
        }
      }
    });
    const double dt =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (round > 0) rounds.push_back(dt);
  }
  std::sort(rounds.begin(), rounds.end());
  const double flops = 2.0 * kRows * kCols * kDepth * reps * threads;
  return flops / rounds[rounds.size() / 2] / 1e9;
}

}  // namespace hp::attention
