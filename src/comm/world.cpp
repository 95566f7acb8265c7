#include "hp/comm/world.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <set>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "heartbeat.h"
#include "hp/comm/collectives.h"
#include "hp/comm/netaddr.h"
#include "hp/comm/store.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"

namespace hp::comm {

struct World::State {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  bool fake = false;
  c10::intrusive_ptr<c10d::Store> store;
  WorldOptions options;
  std::shared_ptr<CommContext> context;
  GroupPtr world_group;
  std::mutex mu;
  int next_group_id = 0;
  std::string store_host;  // a TCPStore's address (from_launch_env): where heartbeats go
  int store_port = 0;
  std::unique_ptr<detail::Heartbeat> heartbeat;  // last: stopped first
};

namespace {

std::string error_text(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

}  // namespace

World::World(std::shared_ptr<State> state) : state_(std::move(state)) {
  state_->context = std::make_shared<CommContext>();
  state_->context->world_rank = state_->rank;
  state_->context->verify_shapes = state_->options.verify_shapes;
  state_->context->tracer = state_->options.tracer;
  state_->context->recorder = state_->options.recorder;
  if (!state_->store_host.empty() && state_->options.heartbeat_interval.count() > 0) {
    detail::HeartbeatTarget target{state_->store_host, state_->store_port, state_->rank,
                                   state_->size, state_->options.hostname};
    state_->heartbeat = std::make_unique<detail::Heartbeat>(
        target, state_->options.heartbeat_interval, state_->context);
    // A failed collective names the peers this rank lost (from their heartbeats).
    state_->context->diagnose_failure = [target] { return detail::diagnose_lost_peers(target); };
  }
  std::vector<int> all(state_->size);
  for (int i = 0; i < state_->size; ++i)
    all[i] = i;
  state_->world_group = new_group(all, "world");
}

World World::from_env(const WorldOptions& options) {
  auto env = parse_launch_env(process_env());
  HP_CHECK(env.has_value(),
           "World::from_env: no launcher variables found. Start under torchrun (RANK, WORLD_SIZE, "
           "MASTER_ADDR, MASTER_PORT), mpirun (OMPI_COMM_WORLD_RANK/SIZE), MPICH mpiexec "
           "(PMI_RANK/PMI_SIZE) or Slurm (SLURM_PROCID/SLURM_NTASKS), or let the tool spawn local "
           "ranks with --nproc N");
  return from_launch_env(*env, options);
}

namespace {

// A write to a socket whose peer left raises SIGPIPE, whose default action ends the process
// silently. Python (and so PyTorch) ignores it; so does a multi-process World: the write fails
// with EPIPE instead and becomes a CommError naming the collective. A handler the program set
// itself is left alone.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

// Every rank announces itself in the store and waits for the others, so a rank that never
// starts (a wrong WORLD_SIZE, a node that did not come up) is named here, once, within one
// timeout. Without it rank 0 went on to create the world group and failed only there, after
// about two timeouts and naming no rank. The keys are the attempt's: the launcher's and
// rank 0's stores are new on every attempt, torchrun's agent store has its attempt prefix.
void wait_for_every_rank(c10d::Store& store, const LaunchEnv& env,
                         std::chrono::milliseconds timeout) {
  auto key = [](int r) { return common::str_cat("hp/joined/", r); };
  store.set(key(env.rank), std::vector<uint8_t>{1});
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r)
    keys.push_back(key(r));
  try {
    store.wait(keys, timeout);
  } catch (const std::exception& e) {
    std::vector<int> missing;
    for (int r = 0; r < env.world_size; ++r) {
      if (!store.check({key(r)})) missing.push_back(r);
    }
    if (missing.empty()) throw;  // not a missing rank: the store's own error
    std::string names;
    const size_t shown = std::min<size_t>(missing.size(), 16);
    for (size_t i = 0; i < shown; ++i)
      names += common::str_cat(i == 0 ? "" : ", ", missing[i]);
    if (shown < missing.size()) names += common::str_cat(" and ", missing.size() - shown, " more");
    throw CommError(common::str_cat(
        "rendezvous on rank ", env.rank, " of ", env.world_size, " (", env.launcher,
        ", TCPStore at ", env.master_addr, ":", env.master_port, "): ", missing.size(), " of ",
        env.world_size, missing.size() == 1 ? " ranks (rank " : " ranks (ranks ", names,
        ") did not join within the timeout (", timeout.count(),
        " ms). Start every rank with WORLD_SIZE=", env.world_size,
        " and the same MASTER_ADDR/MASTER_PORT, or raise the timeout if ranks start slowly"));
  }
}

}  // namespace

World World::from_launch_env(const LaunchEnv& env, const WorldOptions& options) {
  if (env.world_size > 1) ignore_sigpipe_unless_handled();
  auto state = std::make_shared<State>();
  state->rank = env.rank;
  state->size = env.world_size;
  state->local_rank = env.local_rank;
  state->local_size = env.local_world_size;
  state->options = options;
  if (state->options.hostname.empty()) {
    if (!env.transport_addr.empty()) {
      state->options.hostname = env.transport_addr;
    } else if (env.world_size == 1 || is_loopback_host(env.master_addr)) {
      state->options.hostname = "127.0.0.1";
    } else {
      state->options.hostname = local_address_towards(env.master_addr);
    }
  }
  if (env.world_size == 1) {
    state->store = c10::make_intrusive<c10d::HashStore>();
  } else {
    try {
      if (!env.agent_store_prefix.empty()) {  // torchrun's agent hosts it
        state->store = c10::make_intrusive<c10d::PrefixStore>(
            env.agent_store_prefix, join_store(env.master_addr, env.master_port, options.timeout));
      } else if (env.store_on_launcher) {
        state->store = join_store(env.master_addr, env.master_port, options.timeout);
      } else if (env.rank == 0) {
        // Rank 0 hosts the store, listening on MASTER_ADDR's address only (or HP_STORE_BIND).
        StoreServerOptions so;
        so.bind_address = env.store_bind.empty() ? env.master_addr : env.store_bind;
        so.port = env.master_port;
        so.timeout = options.timeout;
        auto store = serve_store(so);
        state->store_host = store->getHost();  // rank 0's heartbeat: where it listens
        state->store = store;
      } else {
        state->store = join_store(env.master_addr, env.master_port, options.timeout);
      }
    } catch (const std::exception& e) {
      std::string why = error_text(e);
      while (!why.empty() && (why.back() == '.' || why.back() == '\n'))
        why.pop_back();
      throw CommError(common::str_cat(
          "rendezvous failed on rank ", env.rank, " of ", env.world_size, " (", env.launcher,
          ", TCPStore at ", env.master_addr, ":", env.master_port, "): ", why,
          ". Check MASTER_ADDR/MASTER_PORT, that the port is free on rank 0, and that every "
          "rank starts within the timeout (",
          options.timeout.count(), " ms)"));
    }
    wait_for_every_rank(*state->store, env, options.timeout);
    if (state->store_host.empty()) state->store_host = env.master_addr;
    state->store_port = env.master_port;
  }
  return World(std::move(state));
}

World World::in_process(int rank, int size, const c10::intrusive_ptr<c10d::Store>& store,
                        const WorldOptions& options) {
  HP_CHECK(size >= 1 && rank >= 0 && rank < size, "World::in_process: rank=", rank, " size=", size,
           " must satisfy 0 <= rank < size");
  HP_CHECK(store, "World::in_process: store is null; pass one store shared by all rank threads");
  auto state = std::make_shared<State>();
  state->rank = rank;
  state->size = size;
  state->local_rank = rank;
  state->local_size = size;
  state->store = store;
  state->options = options;
  return World(std::move(state));
}

World World::fake(int rank, int size, const WorldOptions& options) {
  HP_CHECK(size >= 1 && rank >= 0 && rank < size, "World::fake: rank=", rank, " size=", size,
           " must satisfy 0 <= rank < size");
  auto state = std::make_shared<State>();
  state->rank = rank;
  state->size = size;
  state->local_rank = rank;
  state->local_size = size;
  state->fake = true;
  state->options = options;
  return World(std::move(state));
}

int World::rank() const {
  return state_->rank;
}
int World::size() const {
  return state_->size;
}
int World::local_rank() const {
  return state_->local_rank;
}
int World::local_size() const {
  return state_->local_size;
}
bool World::is_fake() const {
  return state_->fake;
}
const WorldOptions& World::options() const {
  return state_->options;
}
Group& World::group() const {
  return *state_->world_group;
}
GroupPtr World::group_ptr() const {
  return state_->world_group;
}
CommContext& World::context() const {
  return *state_->context;
}
std::shared_ptr<CommContext> World::context_ptr() const {
  return state_->context;
}

GroupPtr World::new_group(const std::vector<int>& world_ranks, const std::string& name,
                          std::optional<std::chrono::milliseconds> timeout_override) const {
  const auto timeout = timeout_override.value_or(state_->options.timeout);
  HP_CHECK(timeout.count() > 0, "new_group '", name, "': timeout ", timeout.count(),
           " ms must be positive");
  HP_CHECK(!world_ranks.empty(), "new_group '", name, "': the rank list is empty");
  std::set<int> seen;
  for (int r : world_ranks) {
    HP_CHECK(r >= 0 && r < state_->size, "new_group '", name, "': rank ", r,
             " is outside the world [0, ", state_->size, ")");
    HP_CHECK(seen.insert(r).second, "new_group '", name, "': rank ", r, " is listed twice");
  }
  int id = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    id = state_->next_group_id++;
  }
  auto it = std::find(world_ranks.begin(), world_ranks.end(), state_->rank);
  if (it == world_ranks.end()) return nullptr;
  const int group_rank = static_cast<int>(it - world_ranks.begin());
  const int n = static_cast<int>(world_ranks.size());

  std::unique_ptr<Transport> transport;
  if (state_->fake) {
    transport = make_fake_transport(n);
  } else if (n == 1) {
    transport = make_self_transport();
  } else {
    auto prefix = common::str_cat("hp/g", id, "/", name);
    for (int r : world_ranks)
      prefix += common::str_cat("_", r);
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, state_->store);
    C10dTransportOptions opts;
    opts.backend = state_->options.backend;
    opts.hostname = state_->options.hostname.empty() ? "127.0.0.1" : state_->options.hostname;
    opts.timeout = timeout;
    try {
      transport = make_c10d_transport(store, group_rank, n, opts);
      // Nobody leaves before every member finished connecting: a rank that raced ahead and
      // exited would close its sockets under a peer still in the handshake.
      store->set(common::str_cat("ready", group_rank), std::vector<uint8_t>{1});
      std::vector<std::string> keys;
      for (int r = 0; r < n; ++r)
        keys.push_back(common::str_cat("ready", r));
      store->wait(keys, timeout);
    } catch (const hp::Error&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(common::str_cat(
          "creating group '", name, "' failed on world rank ", state_->rank, " (group rank ",
          group_rank, " of ", n, "): ", error_text(e),
          ". Every member must create the group, in the same order, within the timeout (",
          timeout.count(), " ms); a member may have exited"));
    }
  }
  return std::make_shared<Group>(name, world_ranks, state_->rank, std::move(transport),
                                 state_->context, timeout);
}

std::chrono::milliseconds timeout_from_seconds(double seconds, const std::string& flag) {
  HP_CHECK(std::isfinite(seconds) && seconds > 0 && seconds <= kMaxTimeoutSeconds, flag, " ",
           seconds, " is not valid: give the group timeout as a number of seconds > 0 and <= ",
           kMaxTimeoutSeconds, " (default ", kDefaultTimeout.count(), ")");
  const auto ms = static_cast<int64_t>(std::ceil(seconds * 1000));
  return std::chrono::milliseconds(ms);
}

void write_world_trace(const World& world, const std::string& path) {
  auto tracer = world.context().tracer;
  HP_CHECK(tracer != nullptr, "write_world_trace('", path,
           "'): this World records no trace; set WorldOptions::tracer when creating it");
  const std::string part = common::str_cat(path, ".rank", world.rank());
  common::write_chrome_trace(part, tracer->events());
  barrier(world.group());
  if (world.rank() == 0) {
    std::vector<common::TraceEvent> all;
    for (int r = 0; r < world.size(); ++r) {
      const std::string p = common::str_cat(path, ".rank", r);
      auto events = common::read_chrome_trace(p);
      all.insert(all.end(), events.begin(), events.end());
      std::remove(p.c_str());
    }
    common::write_chrome_trace(path, all);
  }
  barrier(world.group());
}

}  // namespace hp::comm
