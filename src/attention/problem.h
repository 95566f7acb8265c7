// Internal to attention/: validated shapes of one attention call, and the masks reduced to
// what a [q block x kv block] tile needs. Shared by the math and blockwise primitives, so both
// apply exactly the same visibility rules.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "hp/attention/attention.h"

namespace hp::attention::detail {

struct Problem {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, group = 1;  // group = q_heads / kv_heads
  int64_t q_len = 0, kv_len = 0;
  int64_t qk_dim = 0;  // Dqk: last dim of q and k (the score contraction)
  int64_t v_dim = 0;   // Dv: last dim of v and of out (may differ from Dqk, e.g. MLA)
  double scale = 1.0;
  bool causal = false;
  int64_t q_offset = 0;
  at::ScalarType compute_dtype = at::kFloat;  // float32, or float64 for double inputs
  at::Tensor mask;                            // [Bm, Hm, Sq, Skv] (Bm in {1,B}, Hm in {1,Nq})
  bool mask_is_bool = false;
  std::optional<MaskFunction> mask_fn;
  std::optional<Documents> docs;  // ids as CPU int64 [Bd, S_total]
};

// Checks q/k/v/options (rank, head multiple, matching dims, mask shape, causal metadata) and
// throws hp::Error naming `who`, the field, the value and the fix. q and k must share their last
// dim (qk_dim); v shares B, Nkv and Skv with k and has its own last dim (v_dim).
Problem validate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const AttentionOptions& options, const char* who);

enum class BlockKind : uint8_t { kEmpty = 0, kPartial = 1, kFull = 2 };

// Scores of a tile live in "grouped" layout [B, Nkv, G * bq, bk]: row g*bq + i is query i of
// head kv_head*G + g. TileMask produces masks in that layout.
class TileMask {
 public:
  TileMask(const Problem& p, int64_t block_q, int64_t block_kv);

  int64_t block_q() const { return block_q_; }
  int64_t block_kv() const { return block_kv_; }
  int64_t num_q_blocks() const { return nq_; }
  int64_t num_kv_blocks() const { return nk_; }
  // Empty tiles are skipped, full tiles need no masking.
  BlockKind kind(int64_t qb, int64_t kb) const { return kinds_[qb * nk_ + kb]; }

  // Applies the masks to scores `s` [B, Nkv, G*(qe-qs), ke-ks] of tile (qb, kb) in place:
  // additive mask added, hidden entries set to -inf. `with_causal = false` leaves the causal
  // rule to the caller (the blockwise kernel applies it inline, without a mask tensor).
  void apply(at::Tensor& s, int64_t qb, int64_t kb, bool with_causal = true) const;
  // The same for one (batch b, kv head kvh) tile `s` [G*(qe-qs), ke-ks] of the blockwise
  // kernel, without the causal rule (applied inline there).
  void apply_head(at::Tensor& s, int64_t qb, int64_t kb, int64_t b, int64_t kvh) const;
  // Whether the user masks (tensor mask, mask function, documents) hide part of tile (qb, kb) or
  // add to it: a partial tile without them needs the causal rule only.
  bool user_masked(int64_t qb, int64_t kb) const { return user_masked_[qb * nk_ + kb] != 0; }
  // Whether apply() would do anything besides causal masking.
  bool has_user_masks() const {
    return p_.mask.defined() || p_.mask_fn.has_value() || p_.docs.has_value();
  }

 private:
  // Bool visibility [Bx, Hx, bq, bk] (Hx in {1, Nq}) of the non-causal masks, or undefined.
  at::Tensor visible(int64_t qs, int64_t qe, int64_t ks, int64_t ke) const;
  at::Tensor to_grouped(const at::Tensor& m) const;  // [Bx, Hx, bq, bk] -> [Bx, *, G*bq, bk]

  Problem p_;
  int64_t block_q_, block_kv_, nq_, nk_;
  std::vector<BlockKind> kinds_;
  std::vector<uint8_t> user_masked_;
};

}  // namespace hp::attention::detail
