// Which local address reaches a host: what a rank's transport binds to on a multi-host job (the
// interface on the route to MASTER_ADDR), so peers on other machines can connect to it.
#pragma once

#include <string>

namespace hp::comm {

// True for "localhost", 127.0.0.0/8 and ::1.
bool is_loopback_host(const std::string& host);

// The local IPv4 address the kernel routes `host` (a name or a dotted address) through, found
// without sending anything (a UDP socket "connected" to it). Throws hp::Error naming the host
// when it cannot be resolved or routed.
std::string local_address_towards(const std::string& host);

}  // namespace hp::comm
