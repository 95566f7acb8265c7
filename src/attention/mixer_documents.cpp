// Packed documents for the stateful mixers (mixer.h, run_by_documents): cut, run, put back.
//
//   resets [B, T] -> per row b the document starts 0 = s_0 < s_1 < ... (a reset at 0 only marks
//   that the initial state is dropped) -> documents (b, s_i, len_i), D of them in all
//   q, k, v, g, beta [B, T, ...] --narrow(row b, s_i, len_i), zero-pad to the group's longest-->
//     [D_g, L_g, ...] (g = 0, beta = 0, k = 0 after a document's end: its state is left alone)
//   initial state [D_g, HV, K, V]: row b's for its first document unless resets[b, 0], else 0
//   run(...) per group of documents of similar length (longest first; each joins the group while
//   at least 3/4 of its longest: at most a quarter of a group's slots are padding)
//   -> out [D_g, L_g, HV, V] -> each document's first len_i rows, concatenated per row in order
//   -> [B, T, HV, V]; final state of row b = its last document's
// Within a call the documents of every row run together, so the kernel's rows stay parallel.
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>

#include "hp/attention/mixer.h"
#include "hp/common/check.h"

namespace hp::attention {
namespace {

struct Document {
  int64_t row = 0, start = 0, length = 0;
  bool takes_initial_state = false;
};

std::vector<Document> documents_of(const at::Tensor& resets) {
  auto flags = resets.to(at::kCPU).contiguous();
  const auto* f = flags.data_ptr<bool>();
  const int64_t rows = flags.size(0), tokens = flags.size(1);
  std::vector<Document> docs;
  for (int64_t b = 0; b < rows; ++b) {
    int64_t start = 0;
    for (int64_t t = 1; t <= tokens; ++t) {
      if (t == tokens || f[b * tokens + t]) {
        docs.push_back({b, start, t - start, start == 0 && !f[b * tokens]});
        start = t;
      }
    }
  }
  return docs;
}

// [B, T, ...] -> [D, L, ...]: each document's tokens, zeros after its end.
at::Tensor gather_documents(const at::Tensor& x, const std::vector<Document>& docs,
                            int64_t longest) {
  std::vector<at::Tensor> parts;
  parts.reserve(docs.size());
  for (const auto& d : docs) {
    auto part = x.select(0, d.row).narrow(0, d.start, d.length);
    std::vector<int64_t> widths(2 * part.dim(), 0);  // last dim first; the last pair is dim 0
    widths.back() = longest - d.length;
    parts.push_back(d.length < longest ? at::constant_pad_nd(part, widths) : part);
  }
  return at::stack(parts, 0);
}

// Documents grouped by length for one kernel call each: longest first, a document joins the
// current group while it is at least 3/4 of the group's longest, so a group pads at most a
// quarter of its slots; group lengths fall geometrically, so there are few calls.
std::vector<std::vector<size_t>> length_buckets(const std::vector<Document>& docs) {
  std::vector<size_t> order(docs.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return docs[a].length > docs[b].length; });
  std::vector<std::vector<size_t>> buckets;
  for (size_t i : order) {
    if (buckets.empty() || 4 * docs[i].length < 3 * docs[buckets.back().front()].length)
      buckets.emplace_back();
    buckets.back().push_back(i);
  }
  return buckets;
}

}  // namespace

MixerResult run_by_documents(const MixerInputs& in, const MixerOptions& o, const MixerRun& run) {
  HP_CHECK(!in.resets.defined() ||
               (in.resets.scalar_type() == at::kBool && in.resets.dim() == 2 &&
                in.resets.size(0) == in.q.size(0) && in.resets.size(1) == in.q.size(1)),
           "mixer documents: resets (", c10::toString(in.resets.scalar_type()), " ",
           in.resets.sizes(), ") must be bool [B, T] = [", in.q.size(0), ", ", in.q.size(1),
           "]: true where a document starts");
  if (!in.resets.defined() || !in.resets.any().item<bool>()) {
    auto plain = in;
    plain.resets = at::Tensor();
    return run(plain, o);
  }
  const auto docs = documents_of(in.resets);
  std::vector<at::Tensor> outs(docs.size()), finals(docs.size());
  at::Tensor zero_state;
  if (in.initial_state.defined()) zero_state = at::zeros_like(in.initial_state.select(0, 0));
  for (const auto& bucket : length_buckets(docs)) {
    std::vector<Document> part;
    part.reserve(bucket.size());
    for (size_t i : bucket)
      part.push_back(docs[i]);
    const int64_t longest = part.front().length;
    MixerInputs batch;
    batch.q = gather_documents(in.q, part, longest);
    batch.k = gather_documents(in.k, part, longest);
    batch.v = gather_documents(in.v, part, longest);
    if (in.g.defined()) batch.g = gather_documents(in.g, part, longest);
    if (in.beta.defined()) batch.beta = gather_documents(in.beta, part, longest);
    if (in.initial_state.defined()) {
      std::vector<at::Tensor> states;
      states.reserve(part.size());
      for (const auto& d : part)
        states.push_back(d.takes_initial_state ? in.initial_state.select(0, d.row) : zero_state);
      batch.initial_state = at::stack(states, 0);
    }
    auto res = run(batch, o);
    for (size_t j = 0; j < bucket.size(); ++j) {
      const auto i = static_cast<int64_t>(j);
      outs[bucket[j]] = res.out.select(0, i).narrow(0, 0, part[j].length);
      if (res.final_state.defined()) finals[bucket[j]] = res.final_state.select(0, i);
    }
  }
  // Back in place: documents are in row order, and in token order within a row.
  std::vector<std::vector<at::Tensor>> per_row(static_cast<size_t>(in.q.size(0)));
  std::vector<at::Tensor> last(per_row.size());
  for (size_t i = 0; i < docs.size(); ++i) {
    per_row[static_cast<size_t>(docs[i].row)].push_back(outs[i]);
    last[static_cast<size_t>(docs[i].row)] = finals[i];
  }
  std::vector<at::Tensor> rows;
  rows.reserve(per_row.size());
  for (auto& parts : per_row)
    rows.push_back(at::cat(parts, 0));
  MixerResult out;
  out.out = at::stack(rows, 0);
  if (finals.front().defined()) out.final_state = at::stack(last, 0);
  return out;
}

}  // namespace hp::attention
