// The trainer's data (DESIGN section 10): the embedded copy task, or token ids read from a file.
// Batches are a pure function of (seed, step, micro-batch), so a resumed run sees the same data.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "hp/train/options.h"

namespace hp::train {

// The token ids of --data, read once per run and shared (read-only) by every batch; empty for
// the embedded copy task. Text files are byte-level tokens; `.bin` files hold uint16 or uint32
// ids (--data-dtype). Held at the file's own width (one copy of the file per rank), widened to
// int64 a window at a time.
class Corpus {
 public:
  Corpus() = default;  // the copy task: no file
  // Reads `options.data` (an empty Corpus when it is empty) and checks it against the run: at
  // least seq_len + 1 tokens, every id below the vocabulary, the eod id present when packing;
  // a text file with NUL bytes and uint32 ids read as uint16 are refused.
  static Corpus load(const TrainOptions& options);

  bool empty() const { return !raw_.defined(); }
  int64_t size() const { return empty() ? 0 : raw_.size(0); }  // tokens
  int64_t bytes() const { return empty() ? 0 : raw_.nbytes(); }
  // Tokens [begin, begin + n) as int64 ids.
  at::Tensor ids(int64_t begin, int64_t n) const;
  // "N tokens, CRC-32 X": the CRC-32 of the int64 ids (what checkpoints record and resume
  // compares), computed a chunk at a time.
  std::string fingerprint() const;

 private:
  Corpus(at::Tensor raw, int64_t mask) : raw_(std::move(raw)), mask_(mask) {}
  at::Tensor raw_;    // [N] uint8 (text), or uint16 / uint32 ids as the bits of int16 / int32
  int64_t mask_ = 0;  // the unsigned width's mask
};

// --data names a regular file that exists (not a directory, pipe or device); errors name it.
void check_data_path(const std::string& path);

struct Batch {
  at::Tensor ids, labels;  // [batch, seq_len] int64; labels -100 where nothing is predicted
  at::Tensor doc_ids;      // packed documents: [batch, seq_len] non-decreasing ids; else undefined
};

// One global batch of `options.batch` rows. Without --data, the embedded long-range task: a
// random block of tokens, then the same block again; the loss counts only the second half, so
// it can fall only if attention reaches S/2 tokens back (across CP shards); with
// copy_min_block each row's block has its own length in [copy_min_block, S/2] and follows
// unlabeled random tokens, so the copy distance varies by row. With --data, random
// windows of `corpus` (which must be the Corpus::load of these options) and their next tokens.
// With pack_documents: the copy task packs documents of random even lengths (>= 8), each a copy
// task of its own; --data windows are cut into documents after every eod_id token, and the
// label of an eod_id token (the next document's first token) is -100. Deterministic in
// (seed, step, micro); `micro` > 0 selects another micro-batch of the same step.
Batch make_batch(const TrainOptions& options, const Corpus& corpus, int64_t step,
                 int64_t micro = 0);

}  // namespace hp::train
