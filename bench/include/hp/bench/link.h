// Emulated links for the benchmarks (`--link-rate RATE`): every rank runs inside a fresh
// network namespace whose loopback is rate-limited by a token-bucket qdisc
// (`ip netns add`, `tc qdisc add dev lo root tbf`), so collectives over 127.0.0.1 cost what
// they would on that link. The host's own interfaces are never touched; the namespace is
// removed when the run ends (also on Ctrl-C). All ranks share the one emulated loopback, like
// ranks sharing one node's uplink.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hp::bench {

// "1gbit", "100mbit", "500kbit", "2.5gbit", "1000000bit" -> bits per second; a clear error
// listing the accepted forms otherwise.
int64_t parse_link_rate(const std::string& rate);

// The rate this process runs under when it is inside an emulated link (set by
// run_in_emulated_link for the re-executed tool), nullopt on the plain host.
std::optional<std::string> emulated_link_rate();

// Checks root and iproute2 (clear error naming what is missing), creates the namespace with the
// rate-limited loopback, runs `argv` (this tool's command line without --link-rate) inside it,
// removes the namespace, and returns the run's exit code.
int run_in_emulated_link(const std::string& rate, const std::vector<std::string>& argv);

// `argv` without "--link-rate X" / "--link-rate=X".
std::vector<std::string> strip_link_rate(const std::vector<std::string>& argv);

// Bytes sent over the loopback of this process's network namespace so far (/proc/net/dev).
int64_t loopback_tx_bytes();

}  // namespace hp::bench
