// Internal to comm/: the per-rank heartbeat a World writes into the job's store, which the local
// launcher reads (launcher.cpp) and a failing rank reads to name the peers it lost (world.cpp).
//
//   key   hp/heartbeat/<world rank>
//   value "<beat> <collectives launched>"   beat counts up every WorldOptions::heartbeat_interval
//   key   hp/transport_addr/<world rank>   the address its transport listens on (set once)
//
// A heartbeat comes from a thread of its own, so it stops only when the whole process stops
// (SIGSTOP, a debugger, a frozen machine), ends, or loses its path to the store (a host or link
// gone); the collective count tells how far the rank got (a rank stuck in its own code beats on
// but stops counting).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace hp::comm {
struct CommContext;
}

namespace hp::comm::detail {

inline std::string heartbeat_key(int rank) {
  return "hp/heartbeat/" + std::to_string(rank);
}
inline std::string transport_addr_key(int rank) {
  return "hp/transport_addr/" + std::to_string(rank);
}

// The launcher calls a heartbeat stale (the rank stopped) after this long without a new beat;
// several default intervals, so a busy machine does not make a live rank look stopped.
inline constexpr std::chrono::milliseconds kHeartbeatStale{1500};

// Where the job's store is and who this rank is.
struct HeartbeatTarget {
  std::string store_host;
  int store_port = 0;
  int rank = 0;
  int world_size = 1;
  std::string transport_addr;  // published once under transport_addr_key(rank)
};

// Writes this rank's heartbeat into the job's store every `interval`, through a store client of
// its own (a TCPStore client serialises its calls: the World's own client may sit in a long
// wait). Best effort: without a store connection there is no heartbeat, never an error. Stops
// and joins on destruction.
class Heartbeat {
 public:
  Heartbeat(HeartbeatTarget target, std::chrono::milliseconds interval,
            std::shared_ptr<CommContext> context);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  void run(const HeartbeatTarget& target, std::chrono::milliseconds interval,
           const CommContext& context);

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// Called by a rank whose collective failed: which peers it lost. Joins the store afresh (within
// a few seconds), reads every other rank's heartbeat twice kHeartbeatStale apart and names the
// ranks whose beat did not move, with their transport addresses; when the store itself cannot be
// reached, says so and names its host (rank 0's). Never throws; the text completes an error
// message ("lost peer rank 2 (10.0.0.2) ...").
std::string diagnose_lost_peers(const HeartbeatTarget& target);

}  // namespace hp::comm::detail
