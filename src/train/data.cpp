#include "hp/train/data.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "hp/attention/masks.h"
#include "hp/common/check.h"

namespace hp::train {

void check_data_path(const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  HP_CHECK(std::filesystem::exists(path, ec), "hp-train: --data '", path, "' does not exist");
  HP_CHECK(!std::filesystem::is_directory(path, ec), "hp-train: --data '", path,
           "' is a directory; give a text file or a .bin file of token ids");
}

namespace {

at::Tensor load_tokens(const std::string& path, const std::string& dtype) {
  check_data_path(path);
  std::ifstream f(path, std::ios::binary);
  HP_CHECK(f.good(), "hp-train: cannot open --data '", path, "'");
  std::vector<char> bytes;
  try {
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  } catch (const std::exception& e) {
    HP_CHECK(false, "hp-train: cannot read --data '", path, "': ", e.what());
  }
  HP_CHECK(!f.bad(), "hp-train: cannot read --data '", path, "'");
  HP_CHECK(!bytes.empty(), "hp-train: --data '", path, "' is empty");
  if (path.size() > 4 && path.substr(path.size() - 4) == ".bin") {
    HP_CHECK(dtype == "uint16" || dtype == "uint32", "hp-train: --data-dtype '", dtype,
             "' is not valid; valid: uint16, uint32");
    const size_t width = dtype == "uint16" ? 2 : 4;
    HP_CHECK(bytes.size() % width == 0, "hp-train: '", path, "' is not a whole number of ", dtype,
             " ids (", bytes.size(), " bytes)");
    auto t =
        at::empty({static_cast<int64_t>(bytes.size() / width)}, width == 2 ? at::kShort : at::kInt);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    const int64_t mask = width == 2 ? int64_t{0xFFFF} : int64_t{0xFFFFFFFF};
    return t.to(at::kLong).bitwise_and(mask);  // the ids are unsigned
  }
  auto t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t.to(at::kLong);  // byte-level tokens
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
void corpus_batch(const TrainOptions& o, const at::Tensor& corpus, at::Generator& gen, Batch& b) {
  const int64_t s = o.seq_len;
  auto starts = at::randint(0, corpus.size(0) - s - 1, {o.batch}, gen, at::kLong);
  std::vector<at::Tensor> rows_in, rows_out;
  for (int64_t b = 0; b < o.batch; ++b) {
    const int64_t st = starts[b].item<int64_t>();
    rows_in.push_back(corpus.narrow(0, st, s));
    rows_out.push_back(corpus.narrow(0, st + 1, s));
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
  auto corpus = load_tokens(o.data, o.data_dtype);
  const int64_t s = o.seq_len;
  HP_CHECK(corpus.size(0) > s + 1, "hp-train: --data has ", corpus.size(0),
           " tokens, fewer than --seq-len + 1 = ", s + 1);
  HP_CHECK(corpus.max().item<int64_t>() < o.model.vocab, "hp-train: --data holds token ids up to ",
           corpus.max().item<int64_t>(), " but --vocab is ", o.model.vocab,
           "; raise --vocab (text files need 256)");
  return Corpus(std::move(corpus));
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
  corpus_batch(o, corpus.tokens(), gen, b);
  return b;
}

}  // namespace hp::train
