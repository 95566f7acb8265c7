#include "tile_gemm.h"

#include <dlfcn.h>

#include <limits>

#include <ATen/ATen.h>

#include "hp/common/check.h"

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

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
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
