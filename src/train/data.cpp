#include "hp/train/data.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "hp/attention/masks.h"
#include "hp/common/check.h"
#include "hp/common/crc32.h"

namespace hp::train {

void check_data_path(const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  HP_CHECK(std::filesystem::exists(st), "hp-train: --data '", path, "' ",
           ec && ec != std::errc::no_such_file_or_directory ? "cannot be read: " + ec.message()
                                                            : std::string("does not exist"));
  HP_CHECK(!std::filesystem::is_directory(st), "hp-train: --data '", path,
           "' is a directory; give a text file or a .bin file of token ids");
  // A pipe or a device would be read until it ends (or forever): a run reads its data once,
  // from a file.
  HP_CHECK(std::filesystem::is_regular_file(st), "hp-train: --data '", path,
           "' is not a regular file (a pipe, socket or device); give a text file or a .bin file "
           "of token ids");
}

namespace {

constexpr int64_t kChunk = int64_t{1} << 20;  // tokens widened at a time by the checks

// The ids [begin, begin + n) of `raw` (a file's own width) as int64.
at::Tensor widen(const at::Tensor& raw, int64_t mask, int64_t begin, int64_t n) {
  return raw.narrow(0, begin, n).to(at::kLong).bitwise_and(mask);  // the ids are unsigned
}

struct RawTokens {
  at::Tensor raw;
  int64_t mask = 0;
};

// The file's tokens at its own width, read straight into their tensor (no other copy).
RawTokens load_tokens(const std::string& path, const std::string& dtype) {
  check_data_path(path);
  std::error_code ec;
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  HP_CHECK(!ec, "hp-train: cannot read --data '", path, "': ", ec.message());
  HP_CHECK(size > 0, "hp-train: --data '", path, "' is empty");
  const bool bin = path.size() > 4 && path.substr(path.size() - 4) == ".bin";
  int64_t width = 1;
  RawTokens t;
  if (bin) {
    HP_CHECK(dtype == "uint16" || dtype == "uint32", "hp-train: --data-dtype '", dtype,
             "' is not valid; valid: uint16, uint32");
    width = dtype == "uint16" ? 2 : 4;
    HP_CHECK(size % width == 0, "hp-train: '", path, "' is not a whole number of ", dtype, " ids (",
             size, " bytes)");
  }
  t.raw = at::empty({size / width}, width == 1 ? at::kByte : width == 2 ? at::kShort : at::kInt);
  t.mask = width == 1 ? int64_t{0xFF} : width == 2 ? int64_t{0xFFFF} : int64_t{0xFFFFFFFF};
  std::ifstream f(path, std::ios::binary);
  HP_CHECK(f.good(), "hp-train: cannot open --data '", path, "'");
  f.read(static_cast<char*>(t.raw.data_ptr()), size);
  HP_CHECK(!f.bad() && f.gcount() == size, "hp-train: cannot read --data '", path, "' (read ",
           f.gcount(), " of ", size, " bytes)");
  if (bin) {
    if (width == 2 && t.raw.size(0) >= 64) {
      // uint32 ids read as uint16 are pairs (low half, high half = 0 below 65536): every odd
      // position 0, the even ones not. Trained on, every other token is 0 and no check fails.
      const auto pairs = t.raw.narrow(0, 0, t.raw.size(0) / 2 * 2).view({-1, 2});
      const auto n = static_cast<double>(pairs.size(0));
      const double odd_zero =
          static_cast<double>(pairs.select(1, 1).eq(0).sum().item<int64_t>()) / n;
      const double even_zero =
          static_cast<double>(pairs.select(1, 0).eq(0).sum().item<int64_t>()) / n;
      HP_CHECK(!(odd_zero > 0.95 && even_zero < 0.5), "hp-train: --data '", path,
               "' read as uint16 ids has ", static_cast<int>(odd_zero * 100),
               "% zeros at every second position and ", static_cast<int>(even_zero * 100),
               "% between them: it looks like uint32 ids (low and high halves); pass "
               "--data-dtype uint32");
    }
    return t;
  }
  // Text is byte-level; a NUL byte means a binary file (token ids) under another name.
  HP_CHECK(std::memchr(t.raw.data_ptr(), 0, static_cast<size_t>(size)) == nullptr,
           "hp-train: --data '", path,
           "' holds NUL bytes, so it is not text; a file of token ids must be named *.bin (with "
           "--data-dtype uint16 or uint32)");
  return t;
}

// One copy document of `len` (even) tokens at [begin, begin + len) of every row of `ids`: a random
// block, then the same block again; predict token t+1 from position t only inside the second
// copy.
void copy_document(const TrainOptions& o, at::Generator& gen, at::Tensor ids, at::Tensor labels,
                   int64_t begin, int64_t len) {
  const int64_t half = len / 2;
  auto block = at::randint(1, o.model.vocab, {ids.size(0), half}, gen, at::kLong);
  auto tokens = at::cat({block, block}, 1);
  ids.narrow(1, begin, len).copy_(tokens);
  auto lab = labels.narrow(1, begin, len);
  lab.narrow(1, half, half - 1).copy_(tokens.narrow(1, half + 1, half - 1));
  lab.narrow(1, half - 1, 1).copy_(tokens.narrow(1, half, 1));
}

// The copy task: one document per row (after unlabeled random tokens when the copied block's
// length varies, o.copy_min_block), or packed documents of random even lengths >= 8 (the same
// cuts for every row of the batch).
void copy_task_batch(const TrainOptions& o, at::Generator& gen, Batch& b) {
  const int64_t s = o.seq_len;
  HP_CHECK(s % 2 == 0, "hp-train: --seq-len ", s, " must be even for the copy task");
  b.ids = at::empty({o.batch, s}, at::kLong);
  b.labels = at::full({o.batch, s}, -100, at::kLong);
  if (!o.pack_documents) {
    if (o.copy_min_block == 0 || o.copy_min_block == s / 2) {
      copy_document(o, gen, b.ids, b.labels, 0, s);
      return;
    }
    for (int64_t r = 0; r < o.batch; ++r) {
      const int64_t half =
          at::randint(o.copy_min_block, s / 2 + 1, {1}, gen, at::kLong).item<int64_t>();
      auto ids = b.ids.narrow(0, r, 1), labels = b.labels.narrow(0, r, 1);
      ids.narrow(1, 0, s - 2 * half).random_(1, o.model.vocab, gen);
      copy_document(o, gen, ids, labels, s - 2 * half, 2 * half);
    }
    return;
  }
  HP_CHECK(s >= 16,
           "hp-train: --pack-documents with the copy task needs --seq-len >= 16 (two "
           "documents of at least 8 tokens), got ",
           s);
  std::vector<int64_t> cu{0};
  while (cu.back() < s) {
    const int64_t left = s - cu.back();
    int64_t len =
        2 * at::randint(4, std::max<int64_t>(5, s / 8 + 1), {1}, gen, at::kLong).item<int64_t>();
    if (len > left || left - len < 8) len = left;
    cu.push_back(cu.back() + len);
  }
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    copy_document(o, gen, b.ids, b.labels, cu[d], cu[d + 1] - cu[d]);
  b.doc_ids = attention::document_ids_from_cu_seqlens(cu, s).expand({o.batch, s}).contiguous();
}

// Random windows of the corpus; the labels are the windows shifted by one token. Packed: a
// document ends after every eod_id token, whose label (the next document's first token) is
// -100.
void corpus_batch(const TrainOptions& o, const Corpus& corpus, at::Generator& gen, Batch& b) {
  const int64_t s = o.seq_len;
  // A window and its next tokens span s + 1 tokens: starts 0 .. N - s - 1.
  auto starts = at::randint(0, corpus.size() - s, {o.batch}, gen, at::kLong);
  std::vector<at::Tensor> rows_in, rows_out;
  for (int64_t b = 0; b < o.batch; ++b) {
    const auto window = corpus.ids(starts[b].item<int64_t>(), s + 1);
    rows_in.push_back(window.narrow(0, 0, s));
    rows_out.push_back(window.narrow(0, 1, s));
  }
  b.ids = at::stack(rows_in);
  b.labels = at::stack(rows_out);
  if (o.pack_documents) {
    auto eod = b.ids.eq(o.eod_id).to(at::kLong);
    b.doc_ids = eod.cumsum(1) - eod;  // the eod token closes its own document
    b.labels.masked_fill_(eod.to(at::kBool), -100);
  }
}

}  // namespace

Corpus Corpus::load(const TrainOptions& o) {
  if (o.data.empty()) return Corpus();
  auto t = load_tokens(o.data, o.data_dtype);
  Corpus corpus(std::move(t.raw), t.mask);
  const int64_t s = o.seq_len, n = corpus.size();
  HP_CHECK(n >= s + 1, "hp-train: --data '", o.data, "' has ", n, " tokens; a window of --seq-len ",
           s, " and its next tokens need ", s + 1, ": use --seq-len ", n - 1,
           " or less, or a longer file");
  int64_t top = 0;
  bool eod = false;
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const auto ids = corpus.ids(begin, std::min(kChunk, n - begin));
    top = std::max(top, ids.max().item<int64_t>());
    eod = eod || ids.eq(o.eod_id).any().item<bool>();
  }
  HP_CHECK(top < o.model.vocab, "hp-train: --data '", o.data, "' holds token ids up to ", top,
           " but --vocab is ", o.model.vocab,
           "; raise --vocab (text files need 256), or check --data-dtype for a .bin file");
  HP_CHECK(!o.pack_documents || eod, "hp-train: --eod-id ", o.eod_id, " never occurs in --data '",
           o.data,
           "', so --pack-documents would pack nothing; give the tokenizer's end-of-document id");
  return corpus;
}

at::Tensor Corpus::ids(int64_t begin, int64_t n) const {
  HP_INTERNAL_ASSERT(!empty() && begin >= 0 && n >= 0 && begin + n <= size(), "Corpus::ids: [",
                     begin, ", ", begin + n, ") outside the ", size(), " tokens");
  return widen(raw_, mask_, begin, n);
}

std::string Corpus::fingerprint() const {
  uint32_t crc = 0;
  for (int64_t begin = 0; begin < size(); begin += kChunk) {
    const auto chunk = ids(begin, std::min(kChunk, size() - begin)).contiguous();
    crc = common::crc32(chunk.data_ptr(), static_cast<size_t>(chunk.nbytes()), crc);
  }
  return common::str_cat(size(), " tokens, CRC-32 ", common::crc32_hex(crc));
}

Batch make_batch(const TrainOptions& o, const Corpus& corpus, int64_t step, int64_t micro) {
  uint64_t seed = o.seed * 7919ULL + static_cast<uint64_t>(step);
  if (micro > 0) seed = seed * 1000003ULL + static_cast<uint64_t>(micro);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Batch b;
  if (o.data.empty()) {
    copy_task_batch(o, gen, b);
    return b;
  }
  HP_INTERNAL_ASSERT(!corpus.empty(), "make_batch: --data '", o.data,
                     "' needs the Corpus::load of these options");
  corpus_batch(o, corpus, gen, b);
  return b;
}

}  // namespace hp::train
