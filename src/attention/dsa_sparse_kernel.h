// Internal to attention/: DSA's per-query kernels (attention/dsa.h): the sparse MQA attention,
// the indexer loss and the selection, for a run of queries of one batch row, on raw contiguous
// buffers, one thread. Attention: each selected key's [latent | k_rope] row is read in place
// from kv (no gathered copy): every head's score with it, then (forward) its value contribution
// to every head, or (backward) dQ and its own dKV row, while the row is in L1. Selection slots
// holding -1 are skipped (their probability is 0).
//
//   forward   s[h, j] = q[h] . kv[idx[j]] * scale;  p = softmax_j(s[h, :]);  lse[h]
//             out[h] = sum_j p[h, j] kv[idx[j], :V];  p_mean[j] = mean_h p[h, j]
//   backward  p from s and the forward's lse; dp[h, j] = dout[h] . kv[idx[j], :V];
//             ds = p (dp - dout[h] . out[h]) * scale
//             dq[h] = sum_j ds[h, j] kv[idx[j]]                                (written)
//             dkv[idx[j]] += sum_h ds[h, j] q[h]  (+ sum_h p[h, j] dout[h] on :V)  (accumulated)
#pragma once

#include <cstdint>

namespace hp::attention::detail {

struct SparseMQADims {
  int64_t heads = 0;      // H
  int64_t width = 0;      // C: the row width of q and kv (R + d_rope)
  int64_t value_dim = 0;  // V <= C: a kv row's first V columns are its value
  int64_t topk = 0;       // k: selection slots per query (-1: none)
};

// n queries: q [n, H, C], idx [n, k], kv [Skv, C]; writes out [n, H, V], lse [n, H] (-inf for
// a query with no key) and p_mean [n, k] (0 in empty slots).
void sparse_mqa_forward(const SparseMQADims& d, double scale, int64_t n, const float* q,
                        const int64_t* idx, const float* kv, float* out, float* lse, float* p_mean);
void sparse_mqa_forward(const SparseMQADims& d, double scale, int64_t n, const double* q,
                        const int64_t* idx, const double* kv, double* out, double* lse,
                        double* p_mean);

// n queries, given the forward's out and lse and the incoming dout [n, H, V]: writes dq
// [n, H, C], adds into dkv [Skv, C] (the caller's own buffer: rows are shared between queries).
void sparse_mqa_backward(const SparseMQADims& d, double scale, int64_t n, const float* q,
                         const int64_t* idx, const float* kv, const float* out, const float* dout,
                         const float* lse, float* dq, float* dkv);
void sparse_mqa_backward(const SparseMQADims& d, double scale, int64_t n, const double* q,
                         const int64_t* idx, const double* kv, const double* out,
                         const double* dout, const double* lse, double* dq, double* dkv);

// The indexer loss over the same selection, with its gradients (the loss is a scalar, so they
// are computed with it). n queries: q_index [n, H_I, d_I], w [n, H_I], idx [n, k], k_index
// [Skv, d_I], p [n, k] (the targets, 0 in empty slots):
//   I[j] = sum_h w[h] relu(q_index[h] . k_index[idx[j]]);  lq = log_softmax_j(I)
//   loss = sum_j p[j] (log p[j] - lq[j])  (0 log 0 = 0);  dI = softmax(I) sum_j p - p
// Returns the loss of the n queries; writes dq [n, H_I, d_I] and dw [n, H_I]; adds into dk
// [Skv, d_I] (the caller's own buffer).
struct IndexerDims {
  int64_t heads = 0;  // H_I
  int64_t dim = 0;    // d_I
  int64_t topk = 0;   // k
};
double indexer_loss_rows(const IndexerDims& d, int64_t n, const float* q, const float* w,
                         const int64_t* idx, const float* k, const float* p, float* dq, float* dw,
                         float* dk);
double indexer_loss_rows(const IndexerDims& d, int64_t n, const double* q, const double* w,
                         const int64_t* idx, const double* k, const double* p, double* dq,
                         double* dw, double* dk);

// The selection, per query. index_scores: a [H_I, stride] holds q_index[h] . k_index[j] for n
// keys, w [H_I] the query's index weights; scores[j] = sum_h w[h] relu(a[h][j]) for j < n.
void index_scores(const float* a, int64_t heads, int64_t stride, const float* w, int64_t n,
                  float* scores);
void index_scores(const double* a, int64_t heads, int64_t stride, const double* w, int64_t n,
                  double* scores);
// top_k_positions: the first `visible` scores are the query's visible keys (positions
// 0..visible-1); writes the k best positions in ascending order into out[0, k) (ties at the
// k-th score go to the lower positions; every visible key when visible <= k; -1 past the count).
void top_k_positions(const float* scores, int64_t visible, int64_t k, int64_t* out);
void top_k_positions(const double* scores, int64_t visible, int64_t k, int64_t* out);

}  // namespace hp::attention::detail
