#include "hp/comm/launch_env.h"

#include <cstdlib>

#include "hp/common/check.h"

namespace hp::comm {
namespace {

int parse_int(const EnvLookup& env, const std::string& name, const std::string& launcher) {
  auto v = env(name);
  HP_CHECK(v.has_value(), launcher, " launch: ", name,
           " is not set; the launcher sets it for every rank (set it by hand when starting "
           "ranks yourself)");
  // Slurm writes per-node task counts as "2(x3)": the leading integer is this node's count.
  size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  HP_CHECK(used > 0, launcher, " launch: ", name, "='", *v, "' is not an integer");
  return value;
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
  } else if (env("SLURM_PROCID") || env("SLURM_NTASKS")) {
    out.launcher = "slurm";
    out.rank = parse_int(env, "SLURM_PROCID", out.launcher);
    out.world_size = parse_int(env, "SLURM_NTASKS", out.launcher);
    out.local_rank =
        env("SLURM_LOCALID") ? parse_int(env, "SLURM_LOCALID", out.launcher) : out.rank;
    local_size_var = "SLURM_NTASKS_PER_NODE";
    fallback_addr_var = "SLURM_LAUNCH_NODE_IPADDR";
  } else {
    return std::nullopt;
  }
  out.local_world_size =
      env(local_size_var) ? parse_int(env, local_size_var, out.launcher) : out.world_size;
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
