#include <gtest/gtest.h>

#include <map>

#include <cmath>
#include <limits>

#include "hp/comm/launch_env.h"
#include "hp/comm/transport.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"

namespace hp::comm {
namespace {

EnvLookup env_of(std::map<std::string, std::string> m) {
  return [m](const std::string& k) -> std::optional<std::string> {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(std::map<std::string, std::string> m) {
  try {
    parse_launch_env(env_of(std::move(m)));
  } catch (const hp::Error& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchEnv, NoLauncherGivesNothing) {
  EXPECT_FALSE(parse_launch_env(env_of({})).has_value());
}

TEST(LaunchEnv, Torchrun) {
  auto e = parse_launch_env(env_of({{"RANK", "3"},
                                    {"WORLD_SIZE", "8"},
                                    {"LOCAL_RANK", "1"},
                                    {"LOCAL_WORLD_SIZE", "2"},
                                    {"MASTER_ADDR", "node0"},
                                    {"MASTER_PORT", "1234"}}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->launcher, "torchrun");
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 8);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->local_world_size, 2);
  EXPECT_EQ(e->master_addr, "node0");
  EXPECT_EQ(e->master_port, 1234);
}

TEST(LaunchEnv, Mpirun) {
  auto e = parse_launch_env(env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                    {"MASTER_ADDR", "h"}}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->launcher, "mpirun");
  EXPECT_EQ(e->rank, 2);
  EXPECT_EQ(e->local_world_size, 2);
  EXPECT_EQ(e->master_port, 29500);
}

// MPICH / Intel MPI (Hydra): PMI_* numbers the ranks, MPI_LOCAL* the node's share. Inside a
// Slurm allocation Hydra's proxy carries its node's SLURM_PROCID, which must not win.
TEST(LaunchEnv, MpichHydra) {
  auto e = parse_launch_env(env_of({{"PMI_RANK", "5"},
                                    {"PMI_SIZE", "8"},
                                    {"MPI_LOCALRANKID", "1"},
                                    {"MPI_LOCALNRANKS", "4"},
                                    {"SLURM_PROCID", "1"},
                                    {"SLURM_NTASKS", "2"},
                                    {"MASTER_ADDR", "h"}}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->launcher, "mpiexec");
  EXPECT_EQ(e->rank, 5);
  EXPECT_EQ(e->world_size, 8);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->local_world_size, 4);
  EXPECT_EQ(e->master_addr, "h");
  EXPECT_NE(error_of({{"PMI_RANK", "0"}}).find("mpiexec launch: PMI_SIZE is not set"),
            std::string::npos);
}

TEST(LaunchEnv, SlurmWithNodeAddressFallback) {
  auto e = parse_launch_env(env_of({{"SLURM_PROCID", "5"},
                                    {"SLURM_NTASKS", "8"},
                                    {"SLURM_LOCALID", "1"},
                                    {"SLURM_NTASKS_PER_NODE", "4"},
                                    {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->launcher, "slurm");
  EXPECT_EQ(e->local_world_size, 4);
  EXPECT_EQ(e->master_addr, "10.1.2.3");
}

// Without --ntasks-per-node Slurm gives per-node counts only in its compressed lists; the count
// is this node's (SLURM_NODEID), not the first node's. An allocation's shell (SLURM_NTASKS but
// no SLURM_PROCID: salloc, sbatch) is no launch of ranks.
TEST(LaunchEnv, SlurmTaskListsAndAllocationShells) {
  auto e = parse_launch_env(env_of({{"SLURM_PROCID", "9"},
                                    {"SLURM_NTASKS", "11"},
                                    {"SLURM_LOCALID", "1"},
                                    {"SLURM_NODEID", "2"},
                                    {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"},
                                    {"MASTER_ADDR", "node01"}}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->local_world_size, 3);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "2"},
                      {"SLURM_NODEID", "0"},
                      {"SLURM_TASKS_PER_NODE", "2(y2)"},
                      {"MASTER_ADDR", "h"}})
                .find("slurm launch: SLURM_TASKS_PER_NODE='2(y2)' is not a list of per-node task "
                      "counts like 4(x2),3"),
            std::string::npos);
  EXPECT_FALSE(parse_launch_env(env_of({{"SLURM_NTASKS", "4"}})).has_value());
}

// torchrun's static rendezvous: its agent hosts the store; the ranks join it under the
// attempt's prefix (rank 0 too: serving its own store there fails, the port is taken).
TEST(LaunchEnv, TorchrunAgentStore) {
  auto e = parse_launch_env(env_of({{"RANK", "0"},
                                    {"WORLD_SIZE", "2"},
                                    {"MASTER_ADDR", "h"},
                                    {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                    {"TORCHELASTIC_RESTART_COUNT", "3"}}));
  EXPECT_EQ(e->agent_store_prefix, "/worker/attempt_3");
  EXPECT_FALSE(e->store_on_launcher);  // still an external launcher
  e = parse_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}));
  EXPECT_EQ(e->agent_store_prefix, "");
}

TEST(LaunchEnv, ClearErrors) {
  EXPECT_NE(error_of({{"RANK", "0"}}).find("torchrun launch: WORLD_SIZE is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x' is not an integer"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}})
                .find("rank 2 is outside [0, 2)"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).find("MASTER_ADDR is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT=70000 is not a TCP port"),
            std::string::npos);
  // Trailing text is not an integer (it was read as its leading digits).
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1oops"}}).find("WORLD_SIZE='1oops' is not"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "29500abc"}})
                .find("MASTER_PORT='29500abc' is not an integer"),
            std::string::npos);
}

TEST(LaunchEnv, StoreBindAddress) {
  auto e = parse_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
  EXPECT_EQ(e->store_bind, "");  // MASTER_ADDR's address
  e = parse_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"HP_STORE_BIND", "10.0.0.5"}}));
  EXPECT_EQ(e->store_bind, "10.0.0.5");
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"HP_STORE_BIND", ""}})
                .find("HP_STORE_BIND is set but empty"),
            std::string::npos);
}

TEST(LaunchEnv, TransportAddress) {
  auto e = parse_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
  EXPECT_EQ(e->transport_addr, "");  // World picks the interface towards MASTER_ADDR
  e = parse_launch_env(
      env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"HP_TRANSPORT_ADDR", "10.0.0.7"}}));
  EXPECT_EQ(e->transport_addr, "10.0.0.7");
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"HP_TRANSPORT_ADDR", ""}})
                .find("HP_TRANSPORT_ADDR is set but empty"),
            std::string::npos);
}

TEST(GroupTimeout, OneDefaultEverywhere) {
  EXPECT_EQ(kDefaultTimeout, std::chrono::seconds(300));  // the README's number
  EXPECT_EQ(WorldOptions{}.timeout, kDefaultTimeout);
  EXPECT_EQ(C10dTransportOptions{}.timeout, kDefaultTimeout);
}

TEST(GroupTimeout, SecondsAreChecked) {
  EXPECT_EQ(timeout_from_seconds(2.5), std::chrono::milliseconds(2500));
  EXPECT_EQ(timeout_from_seconds(0.0001), std::chrono::milliseconds(1));  // never rounds to 0
  for (double bad : {0.0, -5.0, std::nan(""), std::numeric_limits<double>::infinity(), 1e7}) {
    std::string msg;
    try {
      timeout_from_seconds(bad, "--timeout");
    } catch (const hp::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("--timeout"), std::string::npos) << bad << ": " << msg;
    EXPECT_NE(msg.find("is not valid"), std::string::npos) << bad << ": " << msg;
  }
}

}  // namespace
}  // namespace hp::comm
