// MLA under CP: checks, the dispatch to the two strategies and their byte formulas.
#include "hp/cp/mla.h"

#include <algorithm>

#include "hp/common/check.h"

namespace hp::cp {

const std::vector<std::string>& mla_cp_strategies() {
  static const std::vector<std::string> names{"latent_all_gather", "ulysses", "all_gather"};
  return names;
}

void check_mla_cp(const std::string& who, const MLACPOptions& options,
                  const attention::MLAShape& shape, int64_t local_seq, int64_t cp_size) {
  const auto& names = mla_cp_strategies();
  HP_CHECK(std::find(names.begin(), names.end(), options.strategy) != names.end(), who,
           ": MLA CP strategy='", options.strategy,
           "' is not valid; valid: latent_all_gather, ulysses, all_gather");
  shape.check(who);
  attention::AttentionRegistry::builtin().get(options.primitive);  // lists the valid names
  if (options.strategy == "ulysses") {
    HP_CHECK(shape.heads % cp_size == 0, who,
             ": MLA heads must be divisible by TP x CP: heads=", shape.heads, ", cp_size=", cp_size,
             "; use strategy=latent_all_gather or a CP size that divides the heads");
    HP_CHECK(!options.load_balance, who,
             ": load_balance applies to strategy=latent_all_gather or all_gather, not ulysses "
             "(every rank sees the whole sequence); drop load_balance");
  }
  if (options.load_balance && cp_size > 1) {
    HP_CHECK(local_seq % 2 == 0, who,
             ": head-tail load balance needs an even local sequence "
             "length, got ",
             local_seq, "; pad the sequence to a multiple of 2 * cp = ", 2 * cp_size);
  }
}

at::Tensor mla_attention_cp(const std::function<at::Tensor()>& queries, const at::Tensor& latent,
                            const at::Tensor& k_rope, const at::Tensor& w_ukv,
                            const attention::MLAShape& shape, const MLACPOptions& options,
                            const CPTopology& topology, const at::Tensor& doc_ids) {
  const std::string who = "MLA CP (" + options.strategy + ")";
  HP_CHECK(latent.defined() && k_rope.defined() && w_ukv.defined(), who,
           ": latent, k_rope and w_ukv are required");
  HP_CHECK(latent.dim() == 3 && latent.size(2) == shape.kv_rank, who, ": latent ", latent.sizes(),
           " must be [B, S/P, kv_rank=", shape.kv_rank, "]");
  HP_CHECK(k_rope.dim() == 3 && k_rope.size(0) == latent.size(0) &&
               k_rope.size(1) == latent.size(1) && k_rope.size(2) == shape.d_rope,
           who, ": k_rope ", k_rope.sizes(), " must be [B, S/P, d_rope=", shape.d_rope,
           "] like latent ", latent.sizes());
  check_mla_cp(who, options, shape, latent.size(1), topology.cp_size);
  if (doc_ids.defined()) {
    const int64_t total = latent.size(1) * topology.cp_size;
    HP_CHECK(doc_ids.dim() == 2 && doc_ids.size(1) == total, who, ": doc_ids ", doc_ids.sizes(),
             " must be the global [B|1, S=", total,
             "] document ids of the whole sequence (the same on every rank), not a shard's");
    attention::check_documents(attention::Documents{doc_ids}, latent.size(0), total, total,
                               who.c_str());
  }
  if (topology.cp_size == 1) {
    return attention::mla_attention(queries(), latent, k_rope, w_ukv, shape, options.primitive,
                                    doc_ids);
  }
  return options.strategy == "ulysses"
             ? detail::mla_ulysses(queries, latent, k_rope, w_ukv, shape, options, topology,
                                   doc_ids)
             : detail::mla_latent_all_gather(queries, latent, k_rope, w_ukv, shape, options,
                                             topology, doc_ids);
}

namespace {

class MLACPInterceptor final : public attention::MLAInterceptor {
 public:
  MLACPInterceptor(std::string path, MLACPOptions options,
                   std::shared_ptr<const CPTopology> topology)
      : path_(std::move(path)), options_(std::move(options)), topology_(std::move(topology)) {}
  std::string id() const override {
    return common::str_cat("mla-cp:", path_, ":", options_.strategy, ":",
                           to_string(options_.schedule), options_.load_balance ? ":lb:" : ":",
                           topology_->id());
  }
  at::Tensor attend(const attention::MLAQueries& queries, const at::Tensor& latent,
                    const at::Tensor& k_rope, const at::Tensor& w_ukv,
                    const attention::MLAShape& shape, const at::Tensor& doc_ids) override {
    return mla_attention_cp(queries, latent, k_rope, w_ukv, shape, options_, *topology_, doc_ids);
  }

 private:
  std::string path_;
  MLACPOptions options_;
  std::shared_ptr<const CPTopology> topology_;
};

}  // namespace

std::string apply_mla_cp(attention::MLAHost& host, const attention::MLAShape& shape,
                         const std::string& module_path, const MLACPOptions& options,
                         const std::shared_ptr<const CPTopology>& topology) {
  HP_CHECK(topology != nullptr, "apply_mla_cp('", module_path,
           "'): no CP topology; build one with CPTopology::build at apply time");
  const std::string who = "MLA CP on module '" + module_path + "'";
  // The local length is checked per call (it is not known here); 2 passes the even check.
  check_mla_cp(who, options, shape, 2, topology->cp_size);
  host.install(std::make_shared<MLACPInterceptor>(module_path, options, topology));
  return common::str_cat("MLA CP: module=", module_path, " strategy=", options.strategy,
                         " schedule=", to_string(options.schedule),
                         options.load_balance ? " load_balance" : "",
                         " cp_size=", topology->cp_size);
}

int64_t mla_forward_bytes_per_rank(const std::string& strategy, const attention::MLAShape& shape,
                                   int64_t batch, int64_t seq, int64_t cp_size,
                                   int64_t element_size) {
  const int64_t p = cp_size, s = seq / p, e = element_size;
  if (strategy == "ulysses") {
    const int64_t in = batch * s * shape.heads * (2 * shape.qk_dim() + shape.d_v) * e;
    const int64_t out = batch * s * shape.heads * shape.d_v * e;
    return (in + out) * (p - 1) / p;
  }
  if (strategy == "all_gather") return mla_expanded_gather_bytes_per_rank(shape, batch, seq, p, e);
  return (p - 1) * batch * s * (shape.kv_rank + shape.d_rope) * e;
}

int64_t mla_expanded_gather_bytes_per_rank(const attention::MLAShape& shape, int64_t batch,
                                           int64_t seq, int64_t cp_size, int64_t element_size) {
  return (cp_size - 1) * batch * (seq / cp_size) * shape.heads * (shape.qk_dim() + shape.d_v) *
         element_size;
}

}  // namespace hp::cp
