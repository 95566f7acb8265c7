// World: this process's place in the job (rank, size, store) and the factory of process groups.
//
// A World is a cheap handle (copies share one state). Nothing here is global: two Worlds, e.g.
// rank threads in one test process, coexist.
//
//   World::from_env()                   torchrun / mpirun / Slurm variables + TCPStore rendezvous
//                                       (rank 0's store, or the local launcher's; store.h)
//   World::in_process(rank, size, st)   threads-as-ranks over a shared store (tests, benches)
//   World::fake(rank, size)             recording fake groups: no communication at all
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "hp/comm/group.h"
#include "hp/comm/launch_env.h"

namespace c10d {
class Store;
}
namespace hp::common {
class Tracer;
}

namespace hp::comm {

struct WorldOptions {
  // Per-group timeout for rendezvous and every collective (DESIGN section 4).
  std::chrono::milliseconds timeout = kDefaultTimeout;
  std::string backend = "gloo";
  // Address the Gloo transport listens on (peers connect to it). Empty: from_launch_env picks
  // HP_TRANSPORT_ADDR, else 127.0.0.1 when MASTER_ADDR is loopback, else the local address on
  // the route to MASTER_ADDR (so ranks on other hosts can reach it); in-process worlds use
  // 127.0.0.1.
  std::string hostname;
  // Exchange shapes before every collective so a mismatch is a clear error on every rank
  // instead of garbage or a hang. Costs one tiny all-gather per collective; tests turn it on.
  bool verify_shapes = false;
  std::shared_ptr<common::Tracer> tracer;        // null: no trace events
  std::shared_ptr<CollectiveRecorder> recorder;  // null: nothing recorded
  // from_env / from_launch_env with more than one rank: a thread of this World writes this
  // rank's heartbeat (a beat count and the collectives launched so far) into the job's store at
  // this interval, so the local launcher can tell a stopped or stuck rank from the ranks that
  // merely waited for it. 0: no heartbeat.
  std::chrono::milliseconds heartbeat_interval{250};
};

class World {
 public:
  static World from_env(const WorldOptions& options = {});
  // With more than one rank, SIGPIPE is ignored from here on unless the program handles it (as
  // Python does): a peer that left makes a write fail with an error, not end this process.
  static World from_launch_env(const LaunchEnv& env, const WorldOptions& options = {});
  static World in_process(int rank, int size, const c10::intrusive_ptr<c10d::Store>& store,
                          const WorldOptions& options = {});
  static World fake(int rank, int size, const WorldOptions& options = {});

  int rank() const;
  int size() const;
  int local_rank() const;
  int local_size() const;
  bool is_fake() const;
  const WorldOptions& options() const;

  Group& group() const;  // all ranks, named "world"
  GroupPtr group_ptr() const;

  // Creates a group of `world_ranks` (in that order). Collective over the whole world: every
  // rank calls it, with the same arguments and in the same order, members or not. Returns null
  // on ranks that are not members. `timeout` overrides WorldOptions::timeout for this group.
  GroupPtr new_group(const std::vector<int>& world_ranks, const std::string& name,
                     std::optional<std::chrono::milliseconds> timeout = std::nullopt) const;

  CommContext& context() const;
  std::shared_ptr<CommContext> context_ptr() const;

 private:
  struct State;
  explicit World(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

// A tool's `--timeout SECONDS` as a group timeout, checked before anything starts: it must be a
// finite number of seconds, > 0 and at most kMaxTimeoutSeconds. Otherwise throws hp::Error
// "<flag> <seconds> is not valid: ...".
inline constexpr double kMaxTimeoutSeconds = 1e6;
std::chrono::milliseconds timeout_from_seconds(double seconds,
                                               const std::string& flag = "--timeout");

// Writes the timeline of every rank of `world` into one Chrome-trace file at `path` (one track
// per rank). Collective over the world: each rank writes `path.rank<r>`, rank 0 merges them into
// `path` and removes the parts. Uses the World's tracer; an error if it has none.
void write_world_trace(const World& world, const std::string& path);

}  // namespace hp::comm
