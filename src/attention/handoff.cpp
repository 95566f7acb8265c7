#include "hp/attention/handoff.h"

#include "hp/common/check.h"

namespace hp::attention {

void HandoffPoint::set_hook(const std::string& owner, Hook hook) {
  HP_CHECK(static_cast<bool>(hook), "HandoffPoint '", name_, "': the hook is empty");
  if (hook_) {
    HP_CHECK(owner_ == owner, "HandoffPoint '", name_, "' is already hooked by '", owner_,
             "'; a second runtime ('", owner, "') cannot use it");
    return;
  }
  owner_ = owner;
  hook_ = std::move(hook);
}

}  // namespace hp::attention
