// Internal to comm/: the one wording of a backend failure (dead peer, timeout, transport).
#pragma once

#include <exception>
#include <string>

#include "hp/comm/group.h"
#include "hp/comm/types.h"

namespace hp::comm::detail {

// First line of the backend's message (without c10's backtrace).
std::string backend_message(const std::exception& e);

// "<op> on group '<g>' (rank r of P, world rank w) failed[ while <phase>]: <backend>. A peer
// rank may have exited, or did not reach this collective within the group timeout of T ms"
[[noreturn]] void throw_comm_failure(OpKind op, const Group& group, const std::string& backend,
                                     const char* phase = nullptr);

}  // namespace hp::comm::detail
