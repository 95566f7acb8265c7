#include "hp/common/check.h"
#include "hp/cp/linear.h"
#include "hp/cp/linear_mixer.h"

namespace hp::cp {

std::string apply_linear_cp(attention::LinearHost& host, const attention::LinearLayerShape& shape,
                            const LinearCPOptions& options,
                            const std::shared_ptr<const CPTopology>& topology) {
  HP_CHECK(topology != nullptr, "apply_linear_cp('", options.module_path,
           "'): no CP topology; build one with CPTopology::build at apply time");
  const int64_t p = topology->cp_size;
  const std::string who = "linear attention CP on module '" + options.module_path + "'";
  check_linear_cp_mode(who, options.mode, options.state_exchange, shape.heads, shape.value_heads,
                       p);
  auto mode = options.mode == "ulysses" ? detail::make_linear_ulysses(options, topology)
                                        : detail::make_linear_state_passing(options, topology);
  host.install(mode);
  return common::str_cat("linear CP: module=", options.module_path, " mode=", options.mode,
                         options.mode == "state_passing" ? " state_exchange=" : "",
                         options.mode == "state_passing" ? options.state_exchange : "",
                         " schedule=", to_string(options.schedule), " cp_size=", p);
}

}  // namespace hp::cp
