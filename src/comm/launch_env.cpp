#include "hp/comm/launch_env.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "hp/common/check.h"

namespace hp::comm {
namespace {

int parse_int(const EnvLookup& env, const std::string& name, const std::string& launcher) {
  auto v = env(name);
  HP_CHECK(v.has_value(), launcher, " launch: ", name,
           " is not set; the launcher sets it for every rank (set it by hand when starting "
           "ranks yourself)");
  size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  HP_CHECK(used > 0 && used == v->size(), launcher, " launch: ", name, "='", *v,
           "' is not an integer");
  return value;
}

// Slurm's compressed per-node task counts ("4(x2),3": 4 tasks on each of the first two nodes,
// 3 on the third): the count of node `node`.
int slurm_tasks_on_node(const std::string& var, const std::string& list, int node) {
  int index = 0;
  size_t at = 0;
  while (at < list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    // "N" or "N(xR)".
    int count = 0, repeat = 1;
    char open = 0, x = 0, close = 0, extra = 0;
    const int fields =
        std::sscanf(item.c_str(), "%d%c%c%d%c%c", &count, &open, &x, &repeat, &close, &extra);
    const bool plain = fields == 1 && item.find_first_not_of("0123456789") == std::string::npos;
    const bool repeated = fields == 5 && open == '(' && x == 'x' && close == ')';
    HP_CHECK(plain || repeated, "slurm launch: ", var, "='", list,
             "' is not a list of per-node task counts like 4(x2),3");
    if (node < index + repeat) return count;
    index += repeat;
    at = end + 1;
  }
  HP_CHECK(false, "slurm launch: ", var, "='", list, "' lists ", index,
           " nodes, but SLURM_NODEID is ", node);
  return 0;
}

std::string master_addr(const EnvLookup& env, const std::string& fallback_var, int world_size,
                        const std::string& launcher) {
  if (auto v = env("MASTER_ADDR")) return *v;
  if (!fallback_var.empty()) {
    if (auto v = env(fallback_var)) return *v;
  }
  HP_CHECK(world_size == 1, launcher, " launch with WORLD_SIZE=", world_size,
           ": MASTER_ADDR is not set; set it to the host of rank 0 (e.g. MASTER_ADDR=node0)");
  return "127.0.0.1";
}

}  // namespace

std::optional<LaunchEnv> parse_launch_env(const EnvLookup& env) {
  LaunchEnv out;
  std::string local_size_var;
  std::optional<int> local_size;  // ranks on this machine, where the launcher says
  std::string fallback_addr_var;
  if (env("RANK") || env("WORLD_SIZE")) {
    out.launcher = "torchrun";
    out.rank = parse_int(env, "RANK", out.launcher);
    out.world_size = parse_int(env, "WORLD_SIZE", out.launcher);
    out.local_rank = env("LOCAL_RANK") ? parse_int(env, "LOCAL_RANK", out.launcher) : out.rank;
    local_size_var = "LOCAL_WORLD_SIZE";
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    out.launcher = "mpirun";
    out.rank = parse_int(env, "OMPI_COMM_WORLD_RANK", out.launcher);
    out.world_size = parse_int(env, "OMPI_COMM_WORLD_SIZE", out.launcher);
    out.local_rank = env("OMPI_COMM_WORLD_LOCAL_RANK")
                         ? parse_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", out.launcher)
                         : out.rank;
    local_size_var = "OMPI_COMM_WORLD_LOCAL_SIZE";
  } else if (env("PMI_RANK") || env("PMI_SIZE")) {
    // MPICH's and Intel MPI's mpiexec (Hydra). Before Slurm: under an allocation Hydra starts
    // its per-node proxies with srun, so SLURM_PROCID there numbers nodes, not ranks.
    out.launcher = "mpiexec";
    out.rank = parse_int(env, "PMI_RANK", out.launcher);
    out.world_size = parse_int(env, "PMI_SIZE", out.launcher);
    out.local_rank =
        env("MPI_LOCALRANKID") ? parse_int(env, "MPI_LOCALRANKID", out.launcher) : out.rank;
    local_size_var = "MPI_LOCALNRANKS";
  } else if (env("SLURM_PROCID")) {  // a task srun started (an allocation's shell has none)
    out.launcher = "slurm";
    out.rank = parse_int(env, "SLURM_PROCID", out.launcher);
    out.world_size = parse_int(env, "SLURM_NTASKS", out.launcher);
    out.local_rank =
        env("SLURM_LOCALID") ? parse_int(env, "SLURM_LOCALID", out.launcher) : out.rank;
    fallback_addr_var = "SLURM_LAUNCH_NODE_IPADDR";
    if (env("SLURM_NTASKS_PER_NODE")) {
      local_size_var = "SLURM_NTASKS_PER_NODE";
    } else {
      for (const char* var : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
        if (auto list = env(var)) {
          const int node = env("SLURM_NODEID") ? parse_int(env, "SLURM_NODEID", out.launcher) : 0;
          local_size = slurm_tasks_on_node(var, *list, node);
          break;
        }
      }
    }
  } else {
    return std::nullopt;
  }
  if (!local_size_var.empty() && env(local_size_var))
    local_size = parse_int(env, local_size_var, out.launcher);
  out.local_world_size = local_size.value_or(out.world_size);  // unknown: all on this machine
  HP_CHECK(out.world_size >= 1, out.launcher, " launch: world size ", out.world_size,
           " must be >= 1");
  HP_CHECK(out.rank >= 0 && out.rank < out.world_size, out.launcher, " launch: rank ", out.rank,
           " is outside [0, ", out.world_size, ")");
  HP_CHECK(
      out.local_rank >= 0 && out.local_world_size >= 1 && out.local_rank < out.local_world_size,
      out.launcher, " launch: local rank ", out.local_rank, " is outside [0, ",
      out.local_world_size, ")");
  out.master_addr = master_addr(env, fallback_addr_var, out.world_size, out.launcher);
  if (env("MASTER_PORT")) {
    out.master_port = parse_int(env, "MASTER_PORT", out.launcher);
    HP_CHECK(out.master_port > 0 && out.master_port < 65536, out.launcher,
             " launch: MASTER_PORT=", out.master_port, " is not a TCP port (1..65535)");
  }
  if (auto v = env("HP_STORE_BIND")) {
    HP_CHECK(!v->empty(), out.launcher,
             " launch: HP_STORE_BIND is set but empty; unset it (the store listens on "
             "MASTER_ADDR's address) or name an address of rank 0's host ('*' for every "
             "interface)");
    out.store_bind = *v;
  }
  out.store_on_launcher = env("HP_STORE_ON_LAUNCHER").value_or("") == "1";
  if (out.launcher == "torchrun" && env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    const auto attempt = env("TORCHELASTIC_RESTART_COUNT").value_or("0");
    out.agent_store_prefix = "/worker/attempt_" + attempt;
  }
  if (auto v = env("HP_TRANSPORT_ADDR")) {
    HP_CHECK(!v->empty(), out.launcher,
             " launch: HP_TRANSPORT_ADDR is set but empty; unset it (the transport uses the "
             "interface on the route to MASTER_ADDR) or name an address of this host");
    out.transport_addr = *v;
  }
  return out;
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

}  // namespace hp::comm
