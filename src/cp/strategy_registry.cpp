#include "hp/cp/strategy.h"

namespace hp::cp {

const StrategyRegistry& StrategyRegistry::builtin() {
  // Built once, never modified afterwards: immutable shared state, not a mutable global.
  static const StrategyRegistry registry = [] {
    StrategyRegistry r;
    r.add(make_all_gather_strategy());
    r.add(make_ulysses_strategy());
    r.add(make_hybrid_strategy());
    r.add(make_ring_strategy());
    r.add(make_usp_strategy());
    return r;
  }();
  return registry;
}

}  // namespace hp::cp
