// Internal to attention/: the float tile GEMM of tile_gemm.h as one AVX-512 register-blocked
// kernel of ours, for CPUs that have AVX-512F. Same contract as detail::gemm (row-major, leading
// dims, beta = 0 only writes C).
//
//   C[m x n] = alpha op(A) op(B) + beta C, computed in register tiles of 6 rows x 64 columns:
//   every k step broadcasts one element of each of the 6 rows of op(A) straight from memory
//   (A as stored, either orientation: nothing is copied) against 4 vectors of one row of op(B).
//   op(B) is read in place when it is stored [k x n]; stored [n x k] (trans_b: the kernels'
//   q k^T and dO v^T), each 64-column panel is transposed once per call into a stack buffer
//   by 16 x 16 register transposes and reused for every row of C.
//
// Why it exists: the blockwise kernels multiply small tiles (K = 64 contractions at D = 64)
// about 10^4 times per call; a BLAS call re-packs both operands each time and, where the
// process's BLAS is pinned to an AVX2 core type, runs at half of what the CPU's 512-bit units
// can do. Nothing here is used for double (the float64 references keep the BLAS path).
#pragma once

#include <cstdint>

namespace hp::attention::detail {

// True where this build has the kernel and the CPU runs AVX-512F (checked once).
bool avx512_gemm_supported();

// The largest k the kernel takes under trans_b (its transposed panel lives on the stack); the
// caller sends larger ones to BLAS. Without trans_b any k is taken.
constexpr int64_t kAvx512GemmMaxPackedK = 256;

// Requires avx512_gemm_supported() and, under trans_b, k <= kAvx512GemmMaxPackedK.
void gemm_avx512(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc);

// A B stored [n x k] (ldb), transposed once into the kernel's panels for several products
// C = alpha A B^T + beta C (the backward multiplies one k block and one v block by every q
// block): avx512_panels_size(n, k) floats, filled by pack_transposed_panels, read by
// gemm_avx512_nt_packed for any n' <= n leading columns. Requires avx512_gemm_supported() and
// k <= kAvx512GemmMaxPackedK.
int64_t avx512_panels_size(int64_t n, int64_t k);
void pack_transposed_panels(const float* b, int64_t ldb, int64_t n, int64_t k, float* panels);
void gemm_avx512_nt_packed(int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                           int64_t lda, const float* panels, float beta, float* c, int64_t ldc);

}  // namespace hp::attention::detail
