// Internal to comm/: the per-rank heartbeat a World writes into the job's store and the local
// launcher reads (world.cpp, launcher.cpp).
//
//   key   hp/heartbeat/<world rank>
//   value "<beat> <collectives launched>"   beat counts up every WorldOptions::heartbeat_interval
//
// A heartbeat comes from a thread of its own, so it stops only when the whole process stops
// (SIGSTOP, a debugger, a frozen machine) or ends; the collective count tells how far the rank
// got (a rank stuck in its own code beats on but stops counting).
#pragma once

#include <chrono>
#include <string>

namespace hp::comm::detail {

inline std::string heartbeat_key(int rank) {
  return "hp/heartbeat/" + std::to_string(rank);
}

// The launcher calls a heartbeat stale (the rank stopped) after this long without a new beat;
// several default intervals, so a busy machine does not make a live rank look stopped.
inline constexpr std::chrono::milliseconds kHeartbeatStale{1500};

}  // namespace hp::comm::detail
