// The job's rendezvous store: c10d's TCPStore, with its server listening on one address only.
//
// LibTorch's TCPStore server listens on every interface and offers no bind address (1.13; later
// versions take a pre-bound socket). serve_store() makes the server's listening socket bind
// the address it is given instead: while it constructs the server, a bind() of a wildcard
// address *on this thread* is redirected to that address (the process's bind() passes
// everything else through unchanged), and afterwards it checks that the listening socket really
// is on that address. Nothing is ever opened to the network by default:
//   * local launches (--nproc, the test harness) listen on 127.0.0.1 (MASTER_ADDR);
//   * multi-host launches listen on the address MASTER_ADDR resolves to on rank 0's host;
//   * HP_STORE_BIND=ADDR (LaunchEnv::store_bind) names another address of rank 0's host, and
//     HP_STORE_BIND='*' (or 0.0.0.0 / ::) asks for every interface explicitly.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "hp/comm/types.h"

namespace c10d {
class TCPStore;
}

namespace hp::comm {

struct StoreServerOptions {
  // Address to listen on: numeric, or a host name resolved here; "*", "0.0.0.0" or "::" for
  // every interface (explicit opt-in only).
  std::string bind_address = "127.0.0.1";
  int port = 0;  // 0: a free port (TCPStore::getPort() tells which)
  // Clients that join through waitForWorkers (counting the server's own client); the server's
  // constructor blocks until they all have. Unset: no waiting.
  std::optional<int> num_workers;
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

// Starts a TCPStore server listening on options.bind_address only (see above). Throws hp::Error
// naming the address when it cannot listen there (not an address of this host, port in use).
c10::intrusive_ptr<c10d::TCPStore> serve_store(const StoreServerOptions& options);

// A client of the store at host:port. With num_workers set it counts itself in the server's
// waitForWorkers; the server must already be there or start within the timeout.
c10::intrusive_ptr<c10d::TCPStore> join_store(const std::string& host, int port,
                                              std::chrono::milliseconds timeout,
                                              std::optional<int> num_workers = std::nullopt);

// The printable local addresses of this process's TCP sockets listening on `port` (an IPv4
// address mapped into IPv6 prints as ::ffff:a.b.c.d).
std::vector<std::string> listening_addresses(int port);

// Whether `address` (as bind_address above) means every interface.
bool is_any_address(const std::string& address);

}  // namespace hp::comm
