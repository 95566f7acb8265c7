// DSA's kernels (see the header). Per query: compact its selected keys; forward, one pass over
// their kv rows for the scores, row-wise softmax on the [H, keys] scratch, one more pass for the
// output; backward, one pass in groups of 8 keys (scores and dP, then p from the forward's lse,
// dS, dQ and each row's dKV while the group's rows are in L1). The indexer loss is one pass
// likewise; the selection scores each visible key and takes the top-k through a sampled
// threshold. Built with the fused row kernels' flags (-O3, reassociation) so the dot products
// and row updates vectorise; the float entry points are cloned for AVX2 (vector_clones.h).
#include "dsa_sparse_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "softmax_rows.h"
#include "vector_clones.h"

// The vector helpers below are always inlined: the note about passing 32-byte vectors without
// AVX (the baseline clone) concerns an ABI no call here uses.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hp::attention::detail {
namespace {

// 32-byte vectors of T (GCC vector extensions: one AVX register in the x86-64-v3 clone, two
// SSE registers in the baseline one); unaligned loads and stores through memcpy.
template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(32)));
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int64_t kLanes = 32 / sizeof(T);

template <typename T>
HP_ALWAYS_INLINE Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
HP_ALWAYS_INLINE void store(T* p, const Vec<T>& v) {
  std::memcpy(p, &v, sizeof(v));
}
template <typename T>
HP_ALWAYS_INLINE T hsum(const Vec<T>& v) {
  T s = 0;
  for (int64_t l = 0; l < kLanes<T>; ++l)
    s += v[l];
  return s;
}

// out[i] = a[i] . b over n columns, for four vectors a[0..3] at once (four independent
// accumulator chains, so the FMA latency is hidden).
template <typename T>
HP_ALWAYS_INLINE void dot4(const T* const* a, const T* __restrict__ b, int64_t n, T* out) {
  constexpr int64_t L = kLanes<T>;
  Vec<T> c0 = {}, c1 = {}, c2 = {}, c3 = {};
  int64_t c = 0;
  for (; c + L <= n; c += L) {
    const Vec<T> r = load(b + c);
    c0 += load<T>(a[0] + c) * r;
    c1 += load<T>(a[1] + c) * r;
    c2 += load<T>(a[2] + c) * r;
    c3 += load<T>(a[3] + c) * r;
  }
  T s0 = hsum<T>(c0), s1 = hsum<T>(c1), s2 = hsum<T>(c2), s3 = hsum<T>(c3);
  for (; c < n; ++c) {
    s0 += a[0][c] * b[c];
    s1 += a[1][c] * b[c];
    s2 += a[2][c] * b[c];
    s3 += a[3][c] * b[c];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// dst[h * stride] = heads[h] . b for every h < H, four heads at a time (the last group padded
// with head 0, its extra results dropped).
template <typename T>
HP_ALWAYS_INLINE void dots(const T* const* heads, int64_t H, const T* b, int64_t n, T* dst,
                           int64_t stride) {
  for (int64_t h0 = 0; h0 < H; h0 += 4) {
    const T* a[4];
    for (int64_t i = 0; i < 4; ++i)
      a[i] = heads[h0 + i < H ? h0 + i : 0];
    T r[4];
    dot4(a, b, n, r);
    for (int64_t i = 0; i < 4 && h0 + i < H; ++i)
      dst[(h0 + i) * stride] = r[i];
  }
}

// y[0, n) += sum_t a[t] * x[t][0, n) for t < nt: four vectors of y stay in registers while
// every x[t] is added (independent chains), so y is loaded and stored once.
template <typename T>
HP_ALWAYS_INLINE void rows_acc(T* __restrict__ y, const T* __restrict__ a, const T* const* x,
                               int64_t nt, int64_t n) {
  constexpr int64_t L = kLanes<T>;
  int64_t c = 0;
  for (; c + 4 * L <= n; c += 4 * L) {
    Vec<T> y0 = load(y + c), y1 = load(y + c + L), y2 = load(y + c + 2 * L),
           y3 = load(y + c + 3 * L);
    for (int64_t t = 0; t < nt; ++t) {
      const T at = a[t];
      const T* xr = x[t] + c;
      y0 += at * load(xr);
      y1 += at * load(xr + L);
      y2 += at * load(xr + 2 * L);
      y3 += at * load(xr + 3 * L);
    }
    store(y + c, y0);
    store(y + c + L, y1);
    store(y + c + 2 * L, y2);
    store(y + c + 3 * L, y3);
  }
  for (; c + L <= n; c += L) {
    Vec<T> y0 = load(y + c);
    for (int64_t t = 0; t < nt; ++t)
      y0 += a[t] * load(x[t] + c);
    store(y + c, y0);
  }
  for (; c < n; ++c) {
    T acc = y[c];
    for (int64_t t = 0; t < nt; ++t)
      acc += a[t] * x[t][c];
    y[c] = acc;
  }
}

// Keys are taken in groups of this many for the row updates (rows_acc's nt).
constexpr int64_t kKeyGroup = 8;

// The selected rows are scattered over kv (and dkv), beyond the caches at long sequences, and
// the hardware cannot guess the next one: each pass asks for the rows this many keys ahead.
constexpr int64_t kPrefetchKeys = 8;

template <int kWrite, typename T>
HP_ALWAYS_INLINE void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(p + b, kWrite, 3);
  __builtin_prefetch(p + bytes - 1, kWrite, 3);
}

// Rows keys[from, to) of base (width n), clamped to m keys.
template <int kWrite, typename T>
HP_ALWAYS_INLINE void prefetch_rows(const T* base, const int64_t* keys, int64_t from, int64_t to,
                                    int64_t m, int64_t n) {
  for (int64_t j = from; j < to && j < m; ++j)
    prefetch_row<kWrite>(base + keys[j] * n, n);
}

// The query's valid keys (kv rows) and the slots they came from; returns their count.
HP_ALWAYS_INLINE int64_t compact_keys(const int64_t* slots_idx, int64_t k, int64_t* keys,
                                      int64_t* slots) {
  int64_t m = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (slots_idx[j] < 0) continue;
    keys[m] = slots_idx[j];
    slots[m++] = j;
  }
  return m;
}

// The group of keys at j0 (at most kKeyGroup): rows[] points at their rows of base (width n);
// the next group's rows are prefetched (their first `prefetch_n` columns, and the same rows of
// `grad` for writing when it is set). Returns the group's size.
template <typename T>
HP_ALWAYS_INLINE int64_t key_group(const T* base, T* grad, const int64_t* keys, int64_t m,
                                   int64_t n, int64_t prefetch_n, int64_t j0, const T** rows) {
  const int64_t from = j0 == 0 ? 0 : j0 + kKeyGroup;
  for (int64_t start = from; start <= j0 + kKeyGroup; start += kKeyGroup) {
    prefetch_rows<0>(base, keys, start, start + kKeyGroup, m, prefetch_n);
    if (grad != nullptr) prefetch_rows<1>(grad, keys, start, start + kKeyGroup, m, n);
  }
  const int64_t g = std::min(kKeyGroup, m - j0);
  for (int64_t j = 0; j < g; ++j)
    rows[j] = base + keys[j0 + j] * n;
  return g;
}

// dst[h * m + j] = heads[h] . base[keys[j]] for every selected key j < m (rows n wide),
// prefetching kPrefetchKeys ahead.
template <typename T>
HP_ALWAYS_INLINE void key_dots(const T* const* heads, int64_t H, const T* base, const int64_t* keys,
                               int64_t m, int64_t n, T* dst) {
  prefetch_rows<0>(base, keys, 0, kPrefetchKeys, m, n);
  for (int64_t j = 0; j < m; ++j) {
    prefetch_rows<0>(base, keys, j + kPrefetchKeys, j + kPrefetchKeys + 1, m, n);
    dots(heads, H, base + keys[j] * n, n, dst + j, m);
  }
}

template <typename T>
HP_ALWAYS_INLINE void forward_impl(const SparseMQADims& d, double scale_d, int64_t n, const T* q,
                                   const int64_t* idx, const T* kv, T* out, T* lse, T* p_mean) {
  const int64_t H = d.heads, C = d.width, V = d.value_dim, k = d.topk;
  const T scale = static_cast<T>(scale_d);
  std::vector<int64_t> keys(k), slots(k);
  std::vector<T> s(H * k);
  std::vector<const T*> q_heads(H);
  for (int64_t i = 0; i < n; ++i) {
    const T* qi = q + i * H * C;
    T* oi = out + i * H * V;
    T* pm = p_mean + i * k;
    const int64_t m = compact_keys(idx + i * k, k, keys.data(), slots.data());
    for (int64_t c = 0; c < H * V; ++c)
      oi[c] = 0;
    for (int64_t j = 0; j < k; ++j)
      pm[j] = 0;
    if (m == 0) {
      for (int64_t h = 0; h < H; ++h)
        lse[i * H + h] = -std::numeric_limits<T>::infinity();
      continue;
    }
    for (int64_t h = 0; h < H; ++h)
      q_heads[h] = qi + h * C;
    key_dots(q_heads.data(), H, kv, keys.data(), m, C, s.data());
    for (int64_t h = 0; h < H; ++h) {
      T* sh = s.data() + h * m;
      for (int64_t j = 0; j < m; ++j)
        sh[j] *= scale;
      const T mx = row_max(sh, m);
      const T sum = exp_shift_sum(sh, m, mx);
      lse[i * H + h] = mx + std::log(sum);
      const T inv = T(1) / sum;
      for (int64_t j = 0; j < m; ++j)
        sh[j] *= inv;
    }
    const T inv_heads = T(1) / static_cast<T>(H);
    for (int64_t j0 = 0; j0 < m; j0 += kKeyGroup) {
      const T* rows[kKeyGroup];
      const int64_t g = key_group<T>(kv, nullptr, keys.data(), m, C, V, j0, rows);
      for (int64_t h = 0; h < H; ++h)
        rows_acc(oi + h * V, s.data() + h * m + j0, rows, g, V);
      for (int64_t j = j0; j < j0 + g; ++j) {
        T mean = 0;
        for (int64_t h = 0; h < H; ++h)
          mean += s[h * m + j];
        pm[slots[j]] = mean * inv_heads;
      }
    }
  }
}

template <typename T>
HP_ALWAYS_INLINE void backward_impl(const SparseMQADims& d, double scale_d, int64_t n, const T* q,
                                    const int64_t* idx, const T* kv, const T* out, const T* dout,
                                    const T* lse, T* dq, T* dkv) {
  const int64_t H = d.heads, C = d.width, V = d.value_dim, k = d.topk;
  const T scale = static_cast<T>(scale_d);
  std::vector<int64_t> keys(k), slots(k);
  std::vector<T> p(H * kKeyGroup), ds(H * kKeyGroup), delta(H), dsj(H), pj(H);
  std::vector<const T*> q_heads(H), do_heads(H);
  for (int64_t i = 0; i < n; ++i) {
    const T* qi = q + i * H * C;
    const T* doi = dout + i * H * V;
    for (int64_t h = 0; h < H; ++h) {
      q_heads[h] = qi + h * C;
      do_heads[h] = doi + h * V;
    }
    T* dqi = dq + i * H * C;
    for (int64_t c = 0; c < H * C; ++c)
      dqi[c] = 0;
    const int64_t m = compact_keys(idx + i * k, k, keys.data(), slots.data());
    if (m == 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const T* oh = out + i * H * V + h * V;
      T acc = 0;
      for (int64_t c = 0; c < V; ++c)
        acc += doi[h * V + c] * oh[c];
      delta[h] = acc;
    }
    // One pass over the keys in groups of kKeyGroup: the group's scores and dP (its rows
    // enter L1), then p = exp(s - lse) and dS for the group, then dQ and each row's dKV from
    // the same rows, still in L1 (the forward's lse makes p known per key: no row pass).
    for (int64_t j0 = 0; j0 < m; j0 += kKeyGroup) {
      const T* rows[kKeyGroup];
      const int64_t g = key_group<T>(kv, dkv, keys.data(), m, C, C, j0, rows);
      // p and ds are [H, kKeyGroup]; the columns past g stay 0.
      std::fill(p.begin(), p.end(), T(0));
      std::fill(ds.begin(), ds.end(), T(0));
      for (int64_t j = 0; j < g; ++j) {
        dots(q_heads.data(), H, rows[j], C, p.data() + j, kKeyGroup);
        dots(do_heads.data(), H, rows[j], V, ds.data() + j, kKeyGroup);
      }
      for (int64_t h = 0; h < H; ++h) {
        const T l = lse[i * H + h];
        for (int64_t j = 0; j < g; ++j)
          p[h * kKeyGroup + j] = p[h * kKeyGroup + j] * scale - l;
      }
      exp_shift_scale(p.data(), H * kKeyGroup, T(0), T(1));
      for (int64_t h = 0; h < H; ++h) {
        const T dh = delta[h];
        for (int64_t j = 0; j < kKeyGroup; ++j) {
          const int64_t at = h * kKeyGroup + j;
          ds[at] = j < g ? p[at] * (ds[at] - dh) * scale : T(0);
        }
      }
      for (int64_t h = 0; h < H; ++h)
        rows_acc(dqi + h * C, ds.data() + h * kKeyGroup, rows, g, C);
      for (int64_t j = 0; j < g; ++j) {
        for (int64_t h = 0; h < H; ++h) {
          dsj[h] = ds[h * kKeyGroup + j];
          pj[h] = p[h * kKeyGroup + j];
        }
        T* drow = dkv + keys[j0 + j] * C;
        rows_acc(drow, dsj.data(), q_heads.data(), H, C);
        rows_acc(drow, pj.data(), do_heads.data(), H, V);
      }
    }
  }
}

template <typename T>
HP_ALWAYS_INLINE double indexer_impl(const IndexerDims& d, int64_t n, const T* q, const T* w,
                                     const int64_t* idx, const T* kk, const T* p, T* dq, T* dw,
                                     T* dk) {
  const int64_t H = d.heads, D = d.dim, k = d.topk;
  std::vector<int64_t> keys(k), slots(k);
  std::vector<T> a(H * k), scores(k), e(k), di(k), dah(H);
  std::vector<const T*> q_heads(H);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T* qi = q + i * H * D;
    const T* wi = w + i * H;
    const T* pi = p + i * k;
    T* dqi = dq + i * H * D;
    T* dwi = dw + i * H;
    for (int64_t c = 0; c < H * D; ++c)
      dqi[c] = 0;
    for (int64_t h = 0; h < H; ++h) {
      dwi[h] = 0;
      q_heads[h] = qi + h * D;
    }
    const int64_t m = compact_keys(idx + i * k, k, keys.data(), slots.data());
    if (m == 0) continue;
    key_dots(q_heads.data(), H, kk, keys.data(), m, D, a.data());
    for (int64_t j = 0; j < m; ++j)
      scores[j] = 0;
    for (int64_t h = 0; h < H; ++h) {
      const T wh = wi[h];
      const T* ah = a.data() + h * m;
      for (int64_t j = 0; j < m; ++j)
        scores[j] += wh * (ah[j] > T(0) ? ah[j] : T(0));
    }
    for (int64_t j = 0; j < m; ++j)
      e[j] = scores[j];
    const T mx = row_max(e.data(), m);
    const T log_z = mx + std::log(exp_shift_sum(e.data(), m, mx));
    T p_sum = 0;
    double kl = 0;
    for (int64_t j = 0; j < m; ++j) {
      const T pj = pi[slots[j]];
      p_sum += pj;
      if (pj > T(0)) kl += static_cast<double>(pj) * (std::log(pj) - (scores[j] - log_z));
    }
    total += kl;
    const T inv_z = std::exp(mx - log_z);  // 1 / sum_j exp(I[j] - mx)
    for (int64_t j = 0; j < m; ++j)
      di[j] = e[j] * inv_z * p_sum - pi[slots[j]];
    // dw[h] = sum_j relu(a) dI;  da = dI w (a > 0), kept in a.
    for (int64_t h = 0; h < H; ++h) {
      T* ah = a.data() + h * m;
      const T wh = wi[h];
      T acc = 0;
      for (int64_t j = 0; j < m; ++j) {
        const bool on = ah[j] > T(0);
        acc += on ? ah[j] * di[j] : T(0);
        ah[j] = on ? di[j] * wh : T(0);
      }
      dwi[h] = acc;
    }
    for (int64_t j0 = 0; j0 < m; j0 += kKeyGroup) {
      const T* rows[kKeyGroup];
      const int64_t g = key_group<T>(kk, dk, keys.data(), m, D, D, j0, rows);
      for (int64_t h = 0; h < H; ++h)
        rows_acc(dqi + h * D, a.data() + h * m + j0, rows, g, D);
      for (int64_t j = j0; j < j0 + g; ++j) {
        for (int64_t h = 0; h < H; ++h)
          dah[h] = a[h * m + j];
        rows_acc(dk + keys[j] * D, dah.data(), q_heads.data(), H, D);
      }
    }
  }
  return total;
}

// The k-th largest of v[0, n) (a selection, not a sort; v is reordered).
template <typename T>
T kth_largest(T* v, int64_t n, int64_t k) {
  std::nth_element(v, v + (k - 1), v + n, std::greater<T>());
  return v[k - 1];
}

template <typename T>
HP_ALWAYS_INLINE void scores_impl(const T* a, int64_t heads, int64_t stride, const T* w, int64_t n,
                                  T* scores) {
  for (int64_t j = 0; j < n; ++j)
    scores[j] = 0;
  for (int64_t h = 0; h < heads; ++h) {
    const T* ah = a + h * stride;
    const T wh = w[h];
    for (int64_t j = 0; j < n; ++j)
      scores[j] += wh * (ah[j] > T(0) ? ah[j] : T(0));
  }
}

template <typename T>
HP_ALWAYS_INLINE void topk_impl(const T* scores, int64_t visible, int64_t k, int64_t* out) {
  int64_t m = 0;
  if (visible <= k) {
    for (; m < visible; ++m)
      out[m] = m;
  } else {
    // A threshold from a sample (above the k-th score's expected rank, with a margin) keeps
    // the exact selection to the few keys at or above it; when fewer than k are, all keys.
    std::vector<int64_t> cand;
    std::vector<T> vals;
    constexpr int64_t kSample = 1024;
    if (visible >= 4 * kSample) {
      std::vector<T> sample(kSample);
      const int64_t step = visible / kSample;
      for (int64_t i = 0; i < kSample; ++i)
        sample[i] = scores[i * step];
      const int64_t rank = std::min<int64_t>(
          kSample, static_cast<int64_t>(1.25 * static_cast<double>(k) * kSample / visible) + 16);
      const T threshold = kth_largest(sample.data(), kSample, rank);
      for (int64_t j = 0; j < visible; ++j) {
        if (scores[j] >= threshold) cand.push_back(j);
      }
      if (static_cast<int64_t>(cand.size()) < k) cand.clear();
    }
    if (cand.empty()) {
      cand.resize(visible);
      for (int64_t j = 0; j < visible; ++j)
        cand[j] = j;
    }
    // Every top-k key is a candidate (at least k candidates score >= the threshold, so the
    // k-th score does too). One pass over them in position order: every key above the k-th
    // score, and its ties while places remain.
    vals.resize(cand.size());
    for (size_t i = 0; i < cand.size(); ++i)
      vals[i] = scores[cand[i]];
    const T kth = kth_largest(vals.data(), static_cast<int64_t>(vals.size()), k);
    int64_t above = 0;
    for (int64_t j : cand)
      above += scores[j] > kth ? 1 : 0;
    int64_t ties = k - above;
    for (size_t i = 0; i < cand.size() && m < k; ++i) {
      const int64_t j = cand[i];
      if (scores[j] > kth) {
        out[m++] = j;
      } else if (scores[j] == kth && ties > 0) {
        out[m++] = j;
        --ties;
      }
    }
  }
  for (; m < k; ++m)
    out[m] = -1;
}

}  // namespace

HP_VECTOR_CLONES void index_scores(const float* a, int64_t heads, int64_t stride, const float* w,
                                   int64_t n, float* scores) {
  scores_impl(a, heads, stride, w, n, scores);
}

void index_scores(const double* a, int64_t heads, int64_t stride, const double* w, int64_t n,
                  double* scores) {
  scores_impl(a, heads, stride, w, n, scores);
}

HP_VECTOR_CLONES void top_k_positions(const float* scores, int64_t visible, int64_t k,
                                      int64_t* out) {
  topk_impl(scores, visible, k, out);
}

void top_k_positions(const double* scores, int64_t visible, int64_t k, int64_t* out) {
  topk_impl(scores, visible, k, out);
}

HP_VECTOR_CLONES double indexer_loss_rows(const IndexerDims& d, int64_t n, const float* q,
                                          const float* w, const int64_t* idx, const float* k,
                                          const float* p, float* dq, float* dw, float* dk) {
  return indexer_impl(d, n, q, w, idx, k, p, dq, dw, dk);
}

double indexer_loss_rows(const IndexerDims& d, int64_t n, const double* q, const double* w,
                         const int64_t* idx, const double* k, const double* p, double* dq,
                         double* dw, double* dk) {
  return indexer_impl(d, n, q, w, idx, k, p, dq, dw, dk);
}

HP_VECTOR_CLONES void sparse_mqa_forward(const SparseMQADims& d, double scale, int64_t n,
                                         const float* q, const int64_t* idx, const float* kv,
                                         float* out, float* lse, float* p_mean) {
  forward_impl(d, scale, n, q, idx, kv, out, lse, p_mean);
}

void sparse_mqa_forward(const SparseMQADims& d, double scale, int64_t n, const double* q,
                        const int64_t* idx, const double* kv, double* out, double* lse,
                        double* p_mean) {
  forward_impl(d, scale, n, q, idx, kv, out, lse, p_mean);
}

HP_VECTOR_CLONES void sparse_mqa_backward(const SparseMQADims& d, double scale, int64_t n,
                                          const float* q, const int64_t* idx, const float* kv,
                                          const float* out, const float* dout, const float* lse,
                                          float* dq, float* dkv) {
  backward_impl(d, scale, n, q, idx, kv, out, dout, lse, dq, dkv);
}

void sparse_mqa_backward(const SparseMQADims& d, double scale, int64_t n, const double* q,
                         const int64_t* idx, const double* kv, const double* out,
                         const double* dout, const double* lse, double* dq, double* dkv) {
  backward_impl(d, scale, n, q, idx, kv, out, dout, lse, dq, dkv);
}

}  // namespace hp::attention::detail
