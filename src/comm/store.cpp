// The rendezvous store on one address (store.h).
//
//   serve_store(bind "127.0.0.1")
//     BindRedirect (this thread) ──> TCPStore server: socket(AF_INET6) + bind([::]:port)
//                                      └─ our bind(): wildcard -> [::ffff:127.0.0.1]:port
//     listening_addresses(port) == {::ffff:127.0.0.1}, or the store is closed and it throws
//
// The bind() below is this process's: it takes precedence over the C library's for every
// caller (LibTorch included) and, unless the calling thread is inside a BindRedirect, calls the
// C library's bind() with the arguments unchanged.
#include "hp/comm/store.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "hp/common/check.h"

namespace hp::comm {
namespace {

// A resolved numeric address.
struct Address {
  int family = AF_INET;
  in_addr v4{};
  in6_addr v6{};
  std::string text;
};

// While non-null on a thread, that thread's bind() of a wildcard address binds this instead.
thread_local const Address* t_bind_redirect = nullptr;

class BindRedirect {
 public:
  explicit BindRedirect(const Address& a) { t_bind_redirect = &a; }
  ~BindRedirect() { t_bind_redirect = nullptr; }
  BindRedirect(const BindRedirect&) = delete;
  BindRedirect& operator=(const BindRedirect&) = delete;
};

Address resolve(const std::string& host) {
  Address a;
  if (inet_pton(AF_INET, host.c_str(), &a.v4) == 1) {
    a.family = AF_INET;
    a.text = host;
    return a;
  }
  if (inet_pton(AF_INET6, host.c_str(), &a.v6) == 1) {
    a.family = AF_INET6;
    a.text = host;
    return a;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &list);
  HP_CHECK(rc == 0 && list != nullptr, "rendezvous store: cannot resolve '", host,
           "' (the address to listen on): ", gai_strerror(rc),
           "; set MASTER_ADDR (or HP_STORE_BIND) to an address of rank 0's host");
  const addrinfo* pick = list;
  for (const addrinfo* i = list; i != nullptr; i = i->ai_next) {
    if (i->ai_family == AF_INET) {  // IPv4 first: it also serves clients that resolve to IPv4
      pick = i;
      break;
    }
  }
  char text[INET6_ADDRSTRLEN] = {};
  a.family = pick->ai_family;
  if (a.family == AF_INET) {
    a.v4 = reinterpret_cast<const sockaddr_in*>(pick->ai_addr)->sin_addr;
    inet_ntop(AF_INET, &a.v4, text, sizeof(text));
  } else {
    a.v6 = reinterpret_cast<const sockaddr_in6*>(pick->ai_addr)->sin6_addr;
    inet_ntop(AF_INET6, &a.v6, text, sizeof(text));
  }
  ::freeaddrinfo(list);
  a.text = text;
  return a;
}

// `a` as it appears on an IPv6 socket: itself, or IPv4 mapped (::ffff:a.b.c.d).
in6_addr as_v6(const Address& a) {
  if (a.family == AF_INET6) return a.v6;
  in6_addr m{};
  m.s6_addr[10] = 0xff;
  m.s6_addr[11] = 0xff;
  std::memcpy(&m.s6_addr[12], &a.v4, 4);
  return m;
}

std::string describe(const sockaddr_storage& s) {
  char text[INET6_ADDRSTRLEN] = {};
  if (s.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&s)->sin_addr, text, sizeof(text));
  } else {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&s)->sin6_addr, text, sizeof(text));
  }
  return text;
}

bool same_address(const std::string& listening, const Address& want) {
  in6_addr got{};
  in_addr got4{};
  if (inet_pton(AF_INET, listening.c_str(), &got4) == 1) {
    Address g;
    g.v4 = got4;
    got = as_v6(g);
  } else if (inet_pton(AF_INET6, listening.c_str(), &got) != 1) {
    return false;
  }
  const in6_addr w = as_v6(want);
  return std::memcmp(&got, &w, sizeof(got)) == 0;
}

c10d::TCPStoreOptions store_options(int port, bool server, std::optional<int> num_workers,
                                    std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = server;
  if (num_workers) opts.numWorkers = static_cast<std::size_t>(*num_workers);
  opts.waitWorkers = num_workers.has_value();
  opts.timeout = timeout;
  return opts;
}

std::string error_text(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

}  // namespace

bool is_any_address(const std::string& address) {
  return address == "*" || address == "0.0.0.0" || address == "::";
}

c10::intrusive_ptr<c10d::TCPStore> serve_store(const StoreServerOptions& o) {
  HP_CHECK(o.port >= 0 && o.port < 65536, "rendezvous store: port ", o.port,
           " is not a TCP port (0..65535)");
  const auto opts = store_options(o.port, true, o.num_workers, o.timeout);
  if (is_any_address(o.bind_address)) {  // asked for explicitly
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  }
  const Address want = resolve(o.bind_address);
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    BindRedirect redirect(want);
    store = c10::make_intrusive<c10d::TCPStore>(want.text, opts);
  } catch (const std::exception& e) {
    throw Error(common::str_cat(
        "rendezvous store: cannot listen on ", o.bind_address,
        o.bind_address == want.text ? "" : common::str_cat(" (", want.text, ")"), " port ", o.port,
        ": ", error_text(e),
        ". It must be an address of rank 0's host (MASTER_ADDR, or HP_STORE_BIND to name "
        "another; HP_STORE_BIND='*' listens on every interface) and the port must be free"));
  }
  const int port = store->getPort();
  const auto addresses = listening_addresses(port);
  for (const auto& a : addresses) {
    HP_CHECK(same_address(a, want), "rendezvous store: the TCPStore server on port ", port,
             " listens on ", a, " although it was asked to listen on ", want.text,
             " only (this LibTorch binds its server socket past hyperparallel's redirection); "
             "set HP_STORE_BIND='*' to accept listening on every interface");
  }
  HP_CHECK(!addresses.empty(), "rendezvous store: no listening socket on port ", port,
           " found in this process after starting the store server");
  return store;
}

c10::intrusive_ptr<c10d::TCPStore> join_store(const std::string& host, int port,
                                              std::chrono::milliseconds timeout,
                                              std::optional<int> num_workers) {
  return c10::make_intrusive<c10d::TCPStore>(host,
                                             store_options(port, false, num_workers, timeout));
}

std::vector<std::string> listening_addresses(int port) {
  std::vector<std::string> out;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  const int dir_fd = ::dirfd(dir);
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    struct stat st {};
    if (fd == dir_fd || ::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_storage s{};
    len = sizeof(s);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&s), &len) != 0) continue;
    int p = -1;
    if (s.ss_family == AF_INET) p = ntohs(reinterpret_cast<const sockaddr_in*>(&s)->sin_port);
    if (s.ss_family == AF_INET6) p = ntohs(reinterpret_cast<const sockaddr_in6*>(&s)->sin6_port);
    if (p == port) out.push_back(describe(s));
  }
  ::closedir(dir);
  return out;
}

}  // namespace hp::comm

// This process's bind(): inside a BindRedirect, a wildcard address (0.0.0.0 or ::) becomes the
// redirect's address on the same port (IPv4-mapped on an IPv6 socket, which LibTorch makes
// dual-stack); anything else goes to the C library's bind() unchanged.
extern "C" int bind(int fd, const struct sockaddr* addr, socklen_t len) noexcept {
  using BindFn = int (*)(int, const struct sockaddr*, socklen_t);
  static const BindFn next = reinterpret_cast<BindFn>(::dlsym(RTLD_NEXT, "bind"));
  auto call = [&](const struct sockaddr* a, socklen_t l) {
    return next != nullptr ? next(fd, a, l) : static_cast<int>(::syscall(SYS_bind, fd, a, l));
  };
  const auto* want = hp::comm::t_bind_redirect;
  if (want == nullptr || addr == nullptr) return call(addr, len);
  if (addr->sa_family == AF_INET && len >= sizeof(sockaddr_in)) {
    sockaddr_in a{};
    std::memcpy(&a, addr, sizeof(a));
    if (a.sin_addr.s_addr != htonl(INADDR_ANY)) return call(addr, len);
    if (want->family != AF_INET) {
      errno = EADDRNOTAVAIL;  // an IPv6 address cannot go on an IPv4 socket
      return -1;
    }
    a.sin_addr = want->v4;
    return call(reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  }
  if (addr->sa_family == AF_INET6 && len >= sizeof(sockaddr_in6)) {
    sockaddr_in6 a{};
    std::memcpy(&a, addr, sizeof(a));
    if (!IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) return call(addr, len);
    a.sin6_addr = hp::comm::as_v6(*want);
    return call(reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  }
  return call(addr, len);
}
