// Fused row kernels of the blockwise attention (see softmax_rows.h). Single-threaded: the
// caller runs one tile per thread. Each row stays in L1 while it is reduced and exponentiated. The
// float path uses a vectorisable exp (range reduction + degree-6 polynomial, relative error <
// 2e-7), compiled for AVX2/FMA when the CPU has it and for baseline x86-64 otherwise; on CPUs
// with AVX-512F the two exp passes run an explicit 16-lane form of the same exp, which lets
// vscalefps apply 2^n (and flush underflow to 0) instead of clamps and integer exponent bits.
#include "softmax_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "vector_clones.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics start masked loads and reductions from _mm512_undefined_ps(),
// which -Wuninitialized reports at every inlining site: a known false positive.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define HP_ROWS_AVX512 1
#define HP_AVX512_INLINE __attribute__((target("avx512f"), always_inline)) inline
#define HP_AVX512_FN __attribute__((target("avx512f")))
#else
#define HP_ROWS_AVX512 0
#endif

namespace hp::attention::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float exp_approx(float x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln2 / 2.
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // nearbyint inlines to one vector round with -fno-trapping-math (x86-64-v3 clone). The
  // 1.5 * 2^23 rounding trick would not survive -fassociative-math.
  const float n = std::nearbyint(xc * 1.4426950408889634f);
  const float r = xc - n * 0.693145751953125f - n * 1.4286068203094172e-06f;
  float p = 1.3888949e-3f;
  p = p * r + 8.3333315e-3f;
  p = p * r + 4.1666672e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

#if HP_ROWS_AVX512
bool rows_have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// exp(x) on 16 lanes: the range reduction and polynomial of exp_approx, 2^n by vscalefps.
// x is clamped below at -110 (exp underflows to exactly 0 there; -inf gives 0); NaN stays NaN
// (vmaxps returns its second operand when either is NaN).
HP_AVX512_INLINE __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203094172e-06f), r);
  __m512 p = _mm512_set1_ps(1.3888949e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333315e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666672e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

HP_AVX512_FN float exp_shift_sum_avx512(float* s, int64_t n, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), sh));
    const __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), sh));
    _mm512_storeu_ps(s + j, e0);
    _mm512_storeu_ps(s + j + 16, e1);
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), sh));
    _mm512_mask_storeu_ps(s + j, m, e);
    sum0 = _mm512_add_ps(sum0, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

HP_AVX512_FN float row_max_avx512(const float* s, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t j = 0;
  // vmaxps returns its second operand where either is NaN: the data goes first, so a NaN
  // score is skipped, as the scalar form does.
  for (; j + 64 <= n; j += 64) {
    m0 = _mm512_max_ps(_mm512_loadu_ps(s + j), m0);
    m1 = _mm512_max_ps(_mm512_loadu_ps(s + j + 16), m1);
    m2 = _mm512_max_ps(_mm512_loadu_ps(s + j + 32), m2);
    m3 = _mm512_max_ps(_mm512_loadu_ps(s + j + 48), m3);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    m0 = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, m, s + j), m0);
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

HP_AVX512_FN void exp_shift_scale_avx512(float* s, int64_t n, float shift, float scale) {
  const __m512 sh = _mm512_set1_ps(shift), sc = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), sh));
    _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(e, sc));
  }
}
#endif

}  // namespace

// s[0, n) <- exp(s - shift); returns the sum.
HP_VECTOR_CLONES float exp_shift_sum(float* s, int64_t n, float shift) {
#if HP_ROWS_AVX512
  if (rows_have_avx512()) return exp_shift_sum_avx512(s, n, shift);
#endif
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_approx(s[j] - shift);
    s[j] = e;
    sum += e;
  }
  return sum;
}

double exp_shift_sum(double* s, int64_t n, double shift) {
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

HP_VECTOR_CLONES float row_max(const float* s, int64_t n) {
#if HP_ROWS_AVX512
  if (rows_have_avx512()) return row_max_avx512(s, n);
#endif
  // 64 lanes: eight independent vector registers in the AVX2 build, so the max chains overlap
  // instead of waiting on one register (handles -inf exactly).
  constexpr int64_t kLanes = 64;
  float lane[kLanes];
  for (int64_t k = 0; k < kLanes; ++k)
    lane[k] = kNegInf;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k)
      lane[k] = s[j + k] > lane[k] ? s[j + k] : lane[k];
  }
  float mx = kNegInf;
  for (; j < n; ++j)
    mx = s[j] > mx ? s[j] : mx;
  for (int64_t k = 0; k < kLanes; ++k)
    mx = lane[k] > mx ? lane[k] : mx;
  return mx;
}

double row_max(const double* s, int64_t n) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j)
    mx = s[j] > mx ? s[j] : mx;
  return mx;
}

// s[0, n) <- exp(s - shift) * scale.
HP_VECTOR_CLONES void exp_shift_scale(float* s, int64_t n, float shift, float scale) {
#if HP_ROWS_AVX512
  if (rows_have_avx512()) return exp_shift_scale_avx512(s, n, shift, scale);
#endif
  for (int64_t j = 0; j < n; ++j)
    s[j] = exp_approx(s[j] - shift) * scale;
}

void exp_shift_scale(double* s, int64_t n, double shift, double scale) {
  for (int64_t j = 0; j < n; ++j)
    s[j] = std::exp(s[j] - shift) * scale;
}

namespace {

HP_VECTOR_CLONES_512 void grad_row(const float* p, float* dp, int64_t n, float delta) {
  for (int64_t j = 0; j < n; ++j)
    dp[j] = p[j] * (dp[j] - delta);
}

void grad_row(const double* p, double* dp, int64_t n, double delta) {
  for (int64_t j = 0; j < n; ++j)
    dp[j] = p[j] * (dp[j] - delta);
}

template <typename T>
bool any_nan(const T* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(row[j])) return true;
  }
  return false;
}

template <typename T>
void zero_tail(T* row, int64_t from, int64_t cols) {
  if (from < cols) std::memset(row + from, 0, sizeof(T) * (cols - from));
}

}  // namespace

template <typename T>
void online_softmax_update(const TileRows& t, T* s, T* m, T* l, T* alpha) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  {
    for (int64_t r = 0; r < t.rows; ++r) {
      T* row = s + r * t.cols;
      const int64_t n = t.visible_cols(r);
      const T mx = n > 0 ? row_max(row, n) : neg_inf;
      const T m_old = m[r];
      const T m_new = mx > m_old ? mx : m_old;
      if (m_new == neg_inf) {   // nothing visible yet (or only NaN): p = 0, state unchanged
        if (any_nan(row, n)) {  // NaN in, NaN out (max() skips NaN)
          const T nan = std::numeric_limits<T>::quiet_NaN();
          std::fill(row, row + t.cols, nan);
          m[r] = l[r] = alpha[r] = nan;
          continue;
        }
        zero_tail(row, 0, t.cols);
        alpha[r] = 1;
        continue;
      }
      const T sum = exp_shift_sum(row, n, m_new);
      zero_tail(row, n, t.cols);
      const T a = m_old == neg_inf ? T(0) : std::exp(m_old - m_new);
      alpha[r] = a;
      l[r] = l[r] * a + sum;
      m[r] = m_new;
    }
  }
}

template <typename T>
void recompute_probs(const TileRows& t, T* s, const T* row_max, const T* inv_sum) {
  for (int64_t r = 0; r < t.rows; ++r) {
    T* row = s + r * t.cols;
    const int64_t n = t.visible_cols(r);
    if (row_max[r] == -std::numeric_limits<T>::infinity()) {  // no visible key in the row
      zero_tail(row, 0, t.cols);
      continue;
    }
    exp_shift_scale(row, n, row_max[r], inv_sum[r]);
    zero_tail(row, n, t.cols);
  }
}

template <typename T>
void softmax_grad(const TileRows& t, const T* p, T* dp, const T* delta) {
  {
    for (int64_t r = 0; r < t.rows; ++r) {
      const int64_t n = t.visible_cols(r);
      grad_row(p + r * t.cols, dp + r * t.cols, n, delta[r]);
      zero_tail(dp + r * t.cols, n, t.cols);
    }
  }
}

template void online_softmax_update<float>(const TileRows&, float*, float*, float*, float*);
template void online_softmax_update<double>(const TileRows&, double*, double*, double*, double*);
template void recompute_probs<float>(const TileRows&, float*, const float*, const float*);
template void recompute_probs<double>(const TileRows&, double*, const double*, const double*);
template void softmax_grad<float>(const TileRows&, const float*, float*, const float*);
template void softmax_grad<double>(const TileRows&, const double*, double*, const double*);

}  // namespace hp::attention::detail
