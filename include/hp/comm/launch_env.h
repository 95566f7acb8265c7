// Reading a job's rank layout from the launcher's environment: torchrun, mpirun (Open MPI),
// mpiexec (MPICH / Intel MPI) or Slurm. Pure functions over an env lookup, so they are testable
// without touching the process environment.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace hp::comm {

struct LaunchEnv {
  std::string launcher;  // "torchrun", "mpirun", "mpiexec" or "slurm"
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // rank 0's TCPStore host
  int master_port = 29500;
  // HP_STORE_BIND: the address rank 0's store listens on. Empty: MASTER_ADDR's address (never
  // every interface by default); "*" (or 0.0.0.0, ::): every interface, explicitly.
  std::string store_bind;
  // HP_STORE_ON_LAUNCHER=1: the local launcher hosts the store at MASTER_ADDR:MASTER_PORT and
  // every rank, rank 0 included, joins it as a client (launcher.h).
  bool store_on_launcher = false;
  // torchrun's static rendezvous (TORCHELASTIC_USE_AGENT_STORE=True): its agent already hosts the
  // store at MASTER_ADDR:MASTER_PORT; every rank joins it as a client, under this prefix
  // ("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>", as torch's own workers do). Empty: none.
  std::string agent_store_prefix;
  // HP_TRANSPORT_ADDR: the local address this rank's Gloo transport listens on. Empty: chosen by
  // World (127.0.0.1 when MASTER_ADDR is loopback, else the interface on the route to it).
  std::string transport_addr;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The launcher's variables, or nullopt when none of the launchers set any. Throws hp::Error
// naming the variable when a value is malformed or inconsistent. The first launcher found
// wins, in this order:
//   torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//             (+ TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT: the agent's store)
//   mpirun:   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (+ MASTER_ADDR/PORT)
//   mpiexec:  PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (MPICH/Intel MPI's Hydra;
//             + MASTER_ADDR/PORT). Before Slurm: Hydra's proxies inside an allocation carry
//             SLURM_PROCID of their node
//   slurm:    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
//             (+ MASTER_ADDR/PORT; MASTER_ADDR defaults to SLURM_LAUNCH_NODE_IPADDR)
//   any:      HP_STORE_BIND (where rank 0's store listens; see store.h), HP_STORE_ON_LAUNCHER
//             (the launcher hosts the store), HP_TRANSPORT_ADDR (this rank's Gloo address)
std::optional<LaunchEnv> parse_launch_env(const EnvLookup& env);

// EnvLookup over this process's environment (getenv).
EnvLookup process_env();

}  // namespace hp::comm
