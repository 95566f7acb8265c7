// Fused row kernels of the blockwise attention (see softmax_rows.h). Single-threaded: the
// caller runs one tile per thread. Each row stays in L1 while it is reduced and exponentiated. The
// float path uses a vectorisable exp (range reduction + degree-6 polynomial, relative error <
// 2e-7), compiled for AVX2/FMA when the CPU has it and for baseline x86-64 otherwise.
#include "softmax_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "vector_clones.h"

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

}  // namespace

// s[0, n) <- exp(s - shift); returns the sum.
HP_VECTOR_CLONES_512 float exp_shift_sum(float* s, int64_t n, float shift) {
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

HP_VECTOR_CLONES_512 float row_max(const float* s, int64_t n) {
  // Eight lanes, so the compiler can keep them in one vector register (handles -inf exactly).
  float lane[8] = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int k = 0; k < 8; ++k)
      lane[k] = s[j + k] > lane[k] ? s[j + k] : lane[k];
  }
  float mx = kNegInf;
  for (; j < n; ++j)
    mx = s[j] > mx ? s[j] : mx;
  for (int k = 0; k < 8; ++k)
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
HP_VECTOR_CLONES_512 void exp_shift_scale(float* s, int64_t n, float shift, float scale) {
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
