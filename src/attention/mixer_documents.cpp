// Packed documents for the stateful mixers (mixer.h, run_by_documents): cut, run, put back.
//
//   resets [B, T] -> per row b the document starts 0 = s_0 < s_1 < ... (a reset at 0 only marks
//   that the initial state is dropped) -> documents (b, s_i, len_i), D of them in all
//   q, k, v, g, beta [B, T, ...] --narrow(row b, s_i, len_i), zero-pad to L = max len_i-->
//     [D, L, ...] (g = 0, beta = 0, k = 0 after a document's end: its state is left alone)
//   initial state [D, HV, K, V]: row b's for its first document unless resets[b, 0], else zeros
//   run(...) once -> out [D, L, HV, V] -> each document's first len_i rows, concatenated per row
//   in order -> [B, T, HV, V]; final state of row b = its last document's
// The padding costs D * L - B * T token slots (at most a factor D / B for one long document);
// every document of the batch runs in the one call, so the kernel's rows stay parallel.
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

}  // namespace

MixerResult run_by_documents(const MixerInputs& in, const MixerOptions& o, const MixerRun& run) {
  if (!in.resets.defined() || !in.resets.any().item<bool>()) {
    auto plain = in;
    plain.resets = at::Tensor();
    return run(plain, o);
  }
  HP_CHECK(in.resets.dim() == 2 && in.resets.size(0) == in.q.size(0) &&
               in.resets.size(1) == in.q.size(1),
           "mixer documents: resets ", in.resets.sizes(), " must be [B, T] = [", in.q.size(0), ", ",
           in.q.size(1), "]");
  const auto docs = documents_of(in.resets);
  int64_t longest = 0;
  for (const auto& d : docs)
    longest = std::max(longest, d.length);
  MixerInputs batch;
  batch.q = gather_documents(in.q, docs, longest);
  batch.k = gather_documents(in.k, docs, longest);
  batch.v = gather_documents(in.v, docs, longest);
  if (in.g.defined()) batch.g = gather_documents(in.g, docs, longest);
  if (in.beta.defined()) batch.beta = gather_documents(in.beta, docs, longest);
  if (in.initial_state.defined()) {
    std::vector<at::Tensor> states;
    states.reserve(docs.size());
    auto zero = at::zeros_like(in.initial_state.select(0, 0));
    for (const auto& d : docs)
      states.push_back(d.takes_initial_state ? in.initial_state.select(0, d.row) : zero);
    batch.initial_state = at::stack(states, 0);
  }
  auto res = run(batch, o);
  std::vector<std::vector<at::Tensor>> per_row(static_cast<size_t>(in.q.size(0)));
  std::vector<int64_t> last(per_row.size(), -1);
  for (size_t i = 0; i < docs.size(); ++i) {
    per_row[static_cast<size_t>(docs[i].row)].push_back(
        res.out.select(0, static_cast<int64_t>(i)).narrow(0, 0, docs[i].length));
    last[static_cast<size_t>(docs[i].row)] = static_cast<int64_t>(i);
  }
  std::vector<at::Tensor> rows;
  rows.reserve(per_row.size());
  for (auto& parts : per_row)
    rows.push_back(at::cat(parts, 0));
  MixerResult out;
  out.out = at::stack(rows, 0);
  if (res.final_state.defined()) {
    out.final_state = res.final_state.index_select(
        0, at::tensor(last, at::TensorOptions().dtype(at::kLong)).to(res.final_state.device()));
  }
  return out;
}

}  // namespace hp::attention
