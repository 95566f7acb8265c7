#include "hp/comm/netaddr.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "hp/common/check.h"

namespace hp::comm {

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found);
  HP_CHECK(rc == 0 && found != nullptr, "cannot resolve '", host, "' (", ::gai_strerror(rc),
           "); set MASTER_ADDR to an address of rank 0's machine");
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  HP_CHECK(fd >= 0, "cannot open a socket to find the route to '", host,
           "': ", std::strerror(errno));
  const bool routed = ::connect(fd, found->ai_addr, found->ai_addrlen) == 0;
  const int connect_errno = errno;
  ::freeaddrinfo(found);
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  const bool named = routed && ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  ::close(fd);
  HP_CHECK(routed, "no route to '", host, "' from this machine: ", std::strerror(connect_errno),
           "; check MASTER_ADDR and the network");
  HP_CHECK(named, "cannot read the local address of the route to '", host, "'");
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
  return text;
}

}  // namespace hp::comm
