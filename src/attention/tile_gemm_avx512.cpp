// The AVX-512 tile GEMM (see the header). Data movement of one call:
//
//   for each 64-column panel j0 of C:
//     op(B)[:, j0:j0+64]  trans_b: transposed 16 x 16 at a time into `panel` [k x 64] (stack),
//                                  or taken from panels the caller packed once for many calls
//                         else:    read in place (row p at b + p*ldb + j0)
//     for each 6-row block i0 of C:
//       24 accumulators (6 rows x 4 vectors of 16) <- sum_p  A(i0+r, p) * op(B)(p, j0:j0+64)
//         A(i, p) is broadcast from a[i*lda + p] (or a[p*lda + i] under trans_a)
//       C[i0:i0+6, j0:j0+64] = alpha * acc (+ beta * C), the last vector masked to n
//
// Only compiled with GCC/Clang on x86-64; elsewhere avx512_gemm_supported() is false.
#include "tile_gemm_avx512.h"

#include <algorithm>

#include "hp/common/check.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics start masked loads and reductions from _mm512_undefined_ps(),
// which -Wuninitialized reports at every inlining site: a known false positive.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define HP_HAVE_AVX512_GEMM 1
#define HP_AVX512 __attribute__((target("avx512f")))
#define HP_AVX512_INLINE __attribute__((target("avx512f"), always_inline)) inline
#else
#define HP_HAVE_AVX512_GEMM 0
#endif

namespace hp::attention::detail {

#if HP_HAVE_AVX512_GEMM
namespace {

constexpr int kMR = 6;                 // rows of C per register tile
constexpr int kNV = 4;                 // 16-float vectors per row of a register tile
constexpr int64_t kNR = 16 * kNV;      // columns of C per panel

// One register tile: C[MR x 16 NV] (the last vector masked by `last`) of the rows at a. Every
// loop over r and v is unrolled (the epilogue's too): where one is left rolled, acc must be
// indexable memory and GCC stores it back to the stack on every k step (3x slower). Each
// instantiation is a function of its own, so none depends on how its caller is inlined.
template <bool TA, int MR, int NV>
__attribute__((target("avx512f"), noinline)) void tile(int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                           float alpha, float beta, float* c, int64_t ldc, __mmask16 last) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = _mm512_setzero_ps();
  const float* rows[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    rows[r] = TA ? a + r : a + r * lda;
  for (int64_t p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = v + 1 < NV ? _mm512_loadu_ps(bp + 16 * v) : _mm512_maskz_loadu_ps(last, bp + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(TA ? rows[r][p * lda] : rows[r][p]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  const __m512 vb = _mm512_set1_ps(beta);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v + 1 < NV ? __mmask16(0xFFFF) : last;
      float* cp = c + r * ldc + 16 * v;
      __m512 x = _mm512_mul_ps(va, acc[r][v]);
      if (beta != 0.0f) x = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask, cp), x);
      _mm512_mask_storeu_ps(cp, mask, x);
    }
  }
}

template <bool TA, int MR>
HP_AVX512_INLINE void tile_cols(int nv, int64_t k, const float* a, int64_t lda, const float* b,
                                int64_t ldb, float alpha, float beta, float* c, int64_t ldc,
                                __mmask16 last) {
  switch (nv) {
    case 1: return tile<TA, MR, 1>(k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    case 2: return tile<TA, MR, 2>(k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    case 3: return tile<TA, MR, 3>(k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    default: return tile<TA, MR, 4>(k, a, lda, b, ldb, alpha, beta, c, ldc, last);
  }
}

template <bool TA>
HP_AVX512 void any_tile(int mr, int nv, int64_t k, const float* a, int64_t lda, const float* b,
                        int64_t ldb, float alpha, float beta, float* c, int64_t ldc,
                        __mmask16 last) {
  static_assert(kMR == 6, "any_tile covers 1..6 rows");
  switch (mr) {
    case 1: return tile_cols<TA, 1>(nv, k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    case 2: return tile_cols<TA, 2>(nv, k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    case 3: return tile_cols<TA, 3>(nv, k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    case 4: return tile_cols<TA, 4>(nv, k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    case 5: return tile_cols<TA, 5>(nv, k, a, lda, b, ldb, alpha, beta, c, ldc, last);
    default: return tile_cols<TA, 6>(nv, k, a, lda, b, ldb, alpha, beta, c, ldc, last);
  }
}

// In place: r[q] lane i <- r[i] lane q (a 16 x 16 transpose in registers).
HP_AVX512_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i+3.
  for (int i = 0; i < 4; ++i) {
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  // Row 4L + c of the result: lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512 a0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const __m512 a1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 b0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 b1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(a0, b0, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(a0, b0, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(a1, b1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(a1, b1, 0xDD);
  }
}

// panel[p * kNR + j] = b[j * ldb + p] for p < k, j < w (b stored [w x k]); columns w..kNR of a
// 16-column group that w enters are zeroed, later groups are not touched (never read).
HP_AVX512 void pack_transposed(const float* b, int64_t ldb, int64_t k, int64_t w, float* panel) {
  for (int64_t j0 = 0; j0 < w; j0 += 16) {
    const int64_t rows = std::min<int64_t>(16, w - j0);
    for (int64_t p0 = 0; p0 < k; p0 += 16) {
      const int64_t cols = std::min<int64_t>(16, k - p0);
      const __mmask16 cm = static_cast<__mmask16>((1u << cols) - 1u);
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_maskz_loadu_ps(cm, b + (j0 + i) * ldb + p0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t q = 0; q < cols; ++q)
        _mm512_storeu_ps(panel + (p0 + q) * kNR + j0, r[q]);
    }
  }
}

// op(B) comes as stored [k x n] (b, ldb), stored [n x k] (tb: transposed here, a panel at a
// time) or already in panels (`packed`, from pack_transposed_panels).
template <bool TA>
HP_AVX512 void run(bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, const float* packed, float beta,
                   float* c, int64_t ldc) {
  alignas(64) float panel[kAvx512GemmMaxPackedK * kNR];
  for (int64_t j0 = 0; j0 < n; j0 += kNR) {
    const int64_t w = std::min(kNR, n - j0);
    const int nv = static_cast<int>((w + 15) / 16);
    const int64_t tail = w - 16 * (nv - 1);
    const __mmask16 last = static_cast<__mmask16>((1u << tail) - 1u);
    const float* bp = b + j0;
    int64_t ldbp = ldb;
    if (packed != nullptr) {
      bp = packed + (j0 / kNR) * k * kNR;
      ldbp = kNR;
    } else if (tb) {
      pack_transposed(b + j0 * ldb, ldb, k, w, panel);
      bp = panel;
      ldbp = kNR;
    }
    for (int64_t i0 = 0; i0 < m; i0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, m - i0));
      const float* ap = TA ? a + i0 : a + i0 * lda;
      any_tile<TA>(mr, nv, k, ap, lda, bp, ldbp, alpha, beta, c + i0 * ldc + j0, ldc, last);
    }
  }
}

}  // namespace

bool avx512_gemm_supported() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

void gemm_avx512(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  HP_INTERNAL_ASSERT(avx512_gemm_supported(), "gemm_avx512 called on a CPU without AVX-512F");
  HP_INTERNAL_ASSERT(!tb || k <= kAvx512GemmMaxPackedK, "gemm_avx512: trans_b with k = ", k, " > ",
                     kAvx512GemmMaxPackedK);
  if (m <= 0 || n <= 0) return;
  if (ta) {
    run<true>(tb, m, n, k, alpha, a, lda, b, ldb, nullptr, beta, c, ldc);
  } else {
    run<false>(tb, m, n, k, alpha, a, lda, b, ldb, nullptr, beta, c, ldc);
  }
}

int64_t avx512_panels_size(int64_t n, int64_t k) {
  return (n + kNR - 1) / kNR * k * kNR;
}

void pack_transposed_panels(const float* b, int64_t ldb, int64_t n, int64_t k, float* panels) {
  HP_INTERNAL_ASSERT(avx512_gemm_supported(), "pack_transposed_panels without AVX-512F");
  for (int64_t j0 = 0; j0 < n; j0 += kNR)
    pack_transposed(b + j0 * ldb, ldb, k, std::min(kNR, n - j0), panels + (j0 / kNR) * k * kNR);
}

void gemm_avx512_nt_packed(int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                           int64_t lda, const float* panels, float beta, float* c, int64_t ldc) {
  HP_INTERNAL_ASSERT(avx512_gemm_supported(), "gemm_avx512_nt_packed without AVX-512F");
  if (m <= 0 || n <= 0) return;
  run<false>(true, m, n, k, alpha, a, lda, nullptr, 0, panels, beta, c, ldc);
}

#else  // no AVX-512 kernel in this build

bool avx512_gemm_supported() {
  return false;
}

void gemm_avx512(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                 const float*, int64_t, float, float*, int64_t) {
  HP_INTERNAL_ASSERT(false, "gemm_avx512: not built for this target");
}

int64_t avx512_panels_size(int64_t, int64_t) {
  return 0;
}

void pack_transposed_panels(const float*, int64_t, int64_t, int64_t, float*) {
  HP_INTERNAL_ASSERT(false, "pack_transposed_panels: not built for this target");
}

void gemm_avx512_nt_packed(int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                           float, float*, int64_t) {
  HP_INTERNAL_ASSERT(false, "gemm_avx512_nt_packed: not built for this target");
}

#endif

}  // namespace hp::attention::detail
