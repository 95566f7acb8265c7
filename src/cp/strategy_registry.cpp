#include "hp/common/check.h"
#include "hp/cp/strategy.h"

namespace hp::cp {

std::vector<std::string> strategy_names() {
  return {"all_gather", "ulysses", "hybrid"};
}

std::shared_ptr<const CPStrategy> strategy_for(const std::string& name) {
  if (name == "all_gather") return make_all_gather_strategy();
  if (name == "ulysses") return make_ulysses_strategy();
  if (name == "hybrid") return make_hybrid_strategy();
  HP_CHECK(false, "unknown CP strategy '", name, "'; valid: all_gather, ulysses, hybrid");
}

}  // namespace hp::cp
