// Internal to attention/: one row-major GEMM on raw pointers, for the kernels' per-tile products.
//
//   C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C      (row-major, leading dims)
//   op(X) = X (trans false) or X^T (trans true: X is stored [k x m] / [n x k])
//   beta = 0: C is only written (its old contents, NaN included, are ignored)
//
// It calls the BLAS LibTorch itself uses (the Fortran sgemm_/dgemm_ found in the process at
// first use), so a tile costs one BLAS call and no ATen dispatch, view or allocation: at
// S = 4096, D = 64 the blockwise kernel makes about 10^4 of them per call. Where the process
// has no such symbol (a LibTorch with its BLAS linked in privately) the same product runs
// through ATen's addmm over views of the same memory.
//
// Float products go instead to our own AVX-512 kernel (tile_gemm_avx512.h) where the CPU has
// AVX-512F: it reads the tiles where they lie (BLAS packs both operands on every call) and uses
// the 512-bit units even where the process's BLAS is pinned to an AVX2 core type. The
// environment variable HP_TILE_GEMM=blas (read once per process) keeps every product on BLAS,
// for comparisons; HP_TILE_GEMM=auto or unset is the default. Double always uses BLAS.
#pragma once

#include <cstdint>
#include <vector>

namespace hp::attention::detail {

enum class TileGemmPath { kBlas, kAvx512 };
// The path float products take in this process (HP_TILE_GEMM and the CPU; a bad value of the
// variable is refused with an error naming it).
TileGemmPath float_tile_gemm_path();
const char* tile_gemm_path_name(TileGemmPath path);

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

// Products C = alpha A B^T + beta C that share one B stored [n x k] (ldb): the backward
// multiplies its k block and its v block by every q block. On the AVX-512 path reset()
// transposes B into the kernel's panels once, instead of once per product; on the BLAS path
// (and for double) each product is one gemm() on B as stored. B must outlive the products.
template <typename T>
class SharedBt {
 public:
  void reset(const T* b, int64_t ldb, int64_t n, int64_t k);
  // C[m x n_used] = alpha A[m x k] B[0:n_used]^T + beta C, n_used <= n.
  void gemm(int64_t m, int64_t n_used, T alpha, const T* a, int64_t lda, T beta, T* c,
            int64_t ldc) const;

 private:
  const T* b_ = nullptr;
  int64_t ldb_ = 0, n_ = 0, k_ = 0;
  bool packed_ = false;
  std::vector<float> panels_;  // the AVX-512 kernel's panels (float only); reused across resets
};

// The BLAS path itself, whatever HP_TILE_GEMM and the CPU say: for tests and comparisons.
void gemm_via_blas(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                   int64_t ldc);

// The fallback path itself (ATen addmm over views), whatever the process has: for tests.
void gemm_via_aten(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                   const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                   double* c, int64_t ldc);

}  // namespace hp::attention::detail
