#include "hp/common/check.h"
#include "hp/cp/strategy.h"

namespace hp::cp {

const char* role_name(QKVRole role) {
  switch (role) {
    case QKVRole::kQ:
      return "q";
    case QKVRole::kK:
      return "k";
    case QKVRole::kV:
      return "v";
  }
  return "?";
}

PreparedQKV CPStrategy::prepare_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const CPRuntimeContext& ctx) const {
  check_inputs(q, ctx);
  at::Tensor moved[3] = {q, k, v};
  for (auto role : moved_roles()) {
    auto& x = moved[static_cast<int>(role)];
    x = move(role, x, ctx);
  }
  return finish(q, moved[0], moved[1], moved[2], ctx);
}

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
