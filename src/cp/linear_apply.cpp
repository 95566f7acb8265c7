#include "hp/common/check.h"
#include "hp/cp/linear.h"

namespace hp::cp {

std::string apply_linear_cp(attention::LinearHost& host, const attention::LinearLayerShape& shape,
                            const LinearCPOptions& options,
                            const std::shared_ptr<const CPTopology>& topology) {
  HP_CHECK(topology != nullptr, "apply_linear_cp('", options.module_path,
           "'): no CP topology; build one with CPTopology::build at apply time");
  const int64_t p = topology->cp_size;
  const std::string who = "linear attention CP on module '" + options.module_path + "'";
  std::shared_ptr<attention::LinearInterceptor> mode;
  if (options.mode == "ulysses") {
    HP_CHECK(shape.heads % p == 0 && shape.value_heads % p == 0, who,
             ": mode=ulysses needs q/k heads (", shape.heads, ") and value heads (",
             shape.value_heads, ") divisible by cp_size=", p,
             "; use mode=state_passing or a cp_size that divides ", shape.heads);
    mode = detail::make_linear_ulysses(options, topology);
  } else if (options.mode == "state_passing") {
    HP_CHECK(options.state_exchange == "all_gather" || options.state_exchange == "p2p", who,
             ": state_exchange='", options.state_exchange,
             "' is not valid; valid: all_gather, p2p");
    mode = detail::make_linear_state_passing(options, topology);
  } else {
    HP_CHECK(false, who, ": mode='", options.mode, "' is not valid; valid: ulysses, state_passing");
  }
  host.install(mode);
  return common::str_cat("linear CP: module=", options.module_path, " mode=", options.mode,
                         options.mode == "state_passing" ? " state_exchange=" : "",
                         options.mode == "state_passing" ? options.state_exchange : "",
                         " cp_size=", p);
}

}  // namespace hp::cp
