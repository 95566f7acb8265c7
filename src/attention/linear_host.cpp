#include "hp/attention/linear_host.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "hp/common/check.h"

namespace hp::attention {

LinearDocuments linear_documents(const at::Tensor& doc_ids, int64_t begin, int64_t n,
                                 int64_t conv_width, int64_t total) {
  LinearDocuments d;
  if (!doc_ids.defined()) return d;
  HP_CHECK(doc_ids.dim() == 2 && doc_ids.scalar_type() == at::kLong,
           "linear attention: doc_ids must be int64 [B|1, S] (the document of every token of the "
           "global sequence); got ",
           c10::toString(doc_ids.scalar_type()), " ", doc_ids.sizes());
  const int64_t s = doc_ids.size(1), w = conv_width;
  HP_CHECK(total < 0 || s == total, "linear attention: doc_ids describe ", s,
           " tokens but the global sequence has ", total,
           "; pass the document ids of the whole global sequence");
  HP_CHECK(begin >= 0 && n >= 0 && begin + n <= s, "linear attention: tokens [", begin, ", ",
           begin + n, ") are not inside the ", s,
           "-token sequence doc_ids describes; pass the document ids of the whole global "
           "sequence");
  // Resets mark where the id changes and the conv keeps taps of the same id: an id that came
  // back after another document would let the conv read the earlier document. Every rank holds
  // the same global ids, so every rank refuses here together.
  HP_CHECK(s < 2 || !doc_ids.slice(1, 1).lt(doc_ids.slice(1, 0, s - 1)).any().item<bool>(),
           "linear attention: doc_ids decrease along the sequence; packed documents need "
           "non-decreasing ids (number the documents in order, padding last)");
  auto ids = doc_ids.narrow(1, begin, n);
  if (n == 0) return {ids.to(at::kBool), ids.to(at::kBool).unsqueeze(-1).expand({-1, 0, w})};
  // The id of the token before each (token 0 compares with itself: never a reset).
  auto before = begin > 0 ? doc_ids.narrow(1, begin - 1, n)
                          : at::cat({ids.narrow(1, 0, 1), ids.narrow(1, 0, n - 1)}, 1);
  d.resets = ids.ne(before);
  // Token ids of the w taps of each row: begin + t + j - (w-1); before token 0: the row's own.
  const int64_t lo = std::max<int64_t>(0, begin - (w - 1));
  auto window = doc_ids.narrow(1, lo, begin + n - lo);
  if (lo > begin - (w - 1)) {  // pad the front with the first row's id: those taps stay kept
    const int64_t pad = lo - (begin - (w - 1));
    window = at::cat({ids.narrow(1, 0, 1).expand({ids.size(0), pad}), window}, 1);
  }
  auto taps = window.unfold(1, w, 1);  // [B|1, n, w]
  d.taps = taps.eq(ids.unsqueeze(-1));
  if (begin < w - 1) {  // taps before token 0 read the zero halo: keep them
    auto pos = at::arange(begin - (w - 1), begin + n, doc_ids.options()).unfold(0, w, 1);
    d.taps = d.taps.logical_or(pos.lt(0).unsqueeze(0));
  }
  return d;
}

at::Tensor run_linear_stages(const at::Tensor& x, const LinearLayerStages& stages,
                             const at::Tensor& doc_ids) {
  const auto shape = stages.shape();
  const auto docs = linear_documents(doc_ids, 0, x.size(1), shape.conv_width, x.size(1));
  auto t = stages.project(x);
  auto conv = stages.convolve(t.qkv, at::Tensor(), at::Tensor(), docs.taps);
  auto in = stages.mixer_inputs(conv, t.beta_logit, t.gate_in, 0, shape.heads);
  if (docs.resets.defined()) in.resets = docs.resets.expand({x.size(0), x.size(1)});
  return stages.output(stages.mix(in, false).out, stages.project_out_gate(x));
}

void LinearHost::install(std::shared_ptr<LinearInterceptor> interceptor) {
  HP_CHECK(interceptor != nullptr, "LinearHost::install: interceptor is null");
  if (interceptor_) {
    HP_CHECK(interceptor_->id() == interceptor->id(),
             "a different CP mode is already installed on this linear-attention layer: "
             "installed '",
             interceptor_->id(), "', new '", interceptor->id(),
             "'. Apply context parallelism once per layer (re-applying the same plan is fine)");
    return;
  }
  interceptor_ = std::move(interceptor);
}

at::Tensor LinearHost::forward(const at::Tensor& x, const LinearLayerStages& stages,
                               const at::Tensor& doc_ids) {
  return interceptor_ ? interceptor_->forward(x, stages, doc_ids)
                      : run_linear_stages(x, stages, doc_ids);
}

}  // namespace hp::attention
