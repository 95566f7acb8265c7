// Internal to attention/: fused per-row passes of the blockwise kernel over one score tile.
//
// A tile is `rows` x `cols` contiguous scores (row-major). Row r is query
// q_first + (r % rows_per_head) of the tile; under causal masking, column c (key
// kv_first + c) is visible iff kv_first + c <= causal_offset + q_first + (r % rows_per_head).
// Columns beyond that are treated as -inf without being read. Scores already -inf (user
// masks) are handled exactly.
#pragma once

#include <cstdint>
#include <limits>

namespace hp::attention::detail {

struct TileRows {
  int64_t rows = 0;           // G * bq (the query heads sharing one KV head)
  int64_t cols = 0;           // bk
  int64_t rows_per_head = 0;  // bq: row r is local query q_first + r % rows_per_head
  bool causal = false;
  int64_t q_first = 0;   // causal: query index of tile row 0 (incl. the causal offset)
  int64_t kv_first = 0;  // causal: key index of tile column 0

  // Number of visible leading columns of row r.
  int64_t visible_cols(int64_t r) const {
    if (!causal) return cols;
    const int64_t last = q_first + r % rows_per_head - kv_first;  // last visible column
    return last < 0 ? 0 : (last + 1 < cols ? last + 1 : cols);
  }
};

// Row primitives (also used by the DSA sparse kernel). Float builds are vectorised for AVX2
// where the CPU has it (vector_clones.h); the float exp is a polynomial, relative error < 2e-7.
// s[0, n) <- exp(s - shift); returns the sum.
float exp_shift_sum(float* s, int64_t n, float shift);
double exp_shift_sum(double* s, int64_t n, double shift);
// s[0, n) <- exp(s - shift) * scale.
void exp_shift_scale(float* s, int64_t n, float shift, float scale);
void exp_shift_scale(double* s, int64_t n, double shift, double scale);
// max of s[0, n) (-inf for n = 0; -inf entries handled exactly).
float row_max(const float* s, int64_t n);
double row_max(const double* s, int64_t n);

// Forward online-softmax update, in place: s <- exp(s - m_new) (0 where hidden), and per row
// m <- m_new = max(m, rowmax s), l <- l * alpha + rowsum p, alpha <- exp(m_old - m_new).
// NaN in, NaN out: a row whose visible scores hold a NaN gets m = l = alpha = NaN and p = NaN,
// so its output, lse and gradients are NaN (never zeros, as an all-NaN row would otherwise
// look like a row with no visible key).
template <typename T>
void online_softmax_update(const TileRows& t, T* s, T* m, T* l, T* alpha);

// Backward: s <- exp(s - row_max) * inv_sum (0 where hidden; row_max = -inf for rows with no
// visible key). row_max and inv_sum = 1/l are the forward's final row statistics.
template <typename T>
void recompute_probs(const TileRows& t, T* s, const T* row_max, const T* inv_sum);

// Backward: dp <- p * (dp - delta) per row.
template <typename T>
void softmax_grad(const TileRows& t, const T* p, T* dp, const T* delta);

}  // namespace hp::attention::detail
