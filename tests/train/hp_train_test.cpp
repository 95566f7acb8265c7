// hp-train end to end: the loss falls on the embedded task; --validate agrees with the
// single-process run; resume continues the exact trajectory (bitwise); bad layouts fail
// before any collective with a clear message.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include <signal.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace {

hp::testing::CommandResult run(const std::string& args) {
  return hp::testing::run_command(std::string(HP_TRAIN_BINARY) + " " + args);
}

nlohmann::json metrics(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

TEST(HpTrain, LearnsTheCopyTaskAndValidates) {
  const std::string m = ::testing::TempDir() + "/train_metrics.json";
  auto r =
      run("--nproc 2 --cp 2 --cp-algo ulysses --schedule async --steps 120 --validate "
          "--metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(m);
  const double first = j["steps"][0]["loss"], last = j["final_loss"];
  EXPECT_LT(last, 0.3 * first) << r.out;
  EXPECT_LT(j["validate"]["max_abs_loss_diff"].get<double>(), 1e-4);
  EXPECT_LT(j["validate"]["max_rel_grad_diff"].get<double>(), 1e-4);
  EXPECT_GT(j["comm_bytes_per_step"]["all_to_all"].get<int64_t>(), 0);
  EXPECT_NE(r.out.find("CP inner-wrap: module=layers.0.self_attn adapter=sdpa_hf "
                       "strategy=ulysses schedule=async"),
            std::string::npos)
      << r.out;
}

TEST(HpTrain, TensorAndContextParallelTogether) {
  const std::string m = ::testing::TempDir() + "/train_tpcp.json";
  auto r =
      run("--nproc 4 --tp 2 --cp 2 --cp-algo all_gather --load-balance --steps 3 "
          "--validate --metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(m);
  EXPECT_LT(j["validate"]["max_abs_loss_diff"].get<double>(), 1e-4);
  EXPECT_LT(j["validate"]["max_rel_grad_diff"].get<double>(), 1e-4);
}

TEST(HpTrain, ValidateModeEqualsProductionBitwise) {
  const std::string dir = ::testing::TempDir();
  const std::string common = "--nproc 4 --tp 2 --cp 2 --steps 3 --heads 8 --kv-heads 4 ";
  auto p = run(common + "--metrics-json " + dir + "/mode_p.json");
  auto v = run(common + "--mode validate --metrics-json " + dir + "/mode_v.json");
  ASSERT_EQ(p.rc, 0) << p.out;
  ASSERT_EQ(v.rc, 0) << v.out;
  EXPECT_NE(v.out.find("(validate mode)"), std::string::npos) << v.out;
  auto a = metrics(dir + "/mode_p.json")["steps"], b = metrics(dir + "/mode_v.json")["steps"];
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>());
}

// 6 steps in one run equal 3 steps + resume + 3 steps, bitwise, for `layout`.
void expect_exact_resume(const std::string& name, const std::string& layout) {
  namespace fs = std::filesystem;
  const std::string dir = ::testing::TempDir() + "/hp_train_ckpt_" + name;
  fs::remove_all(dir);
  const std::string common = layout + " --steps 6 --checkpoint-every 3 ";
  auto full = run(common + "--metrics-json " + dir + "_full.json");
  ASSERT_EQ(full.rc, 0) << full.out;
  auto first = run(layout + " --steps 3 --checkpoint-every 3 --checkpoint-dir " + dir +
                   " --metrics-json " + dir + "_a.json");
  ASSERT_EQ(first.rc, 0) << first.out;
  ASSERT_TRUE(fs::exists(dir + "/step_00000003/manifest.json"));
  auto second =
      run(common + "--checkpoint-dir " + dir + " --resume --metrics-json " + dir + "_b.json");
  ASSERT_EQ(second.rc, 0) << second.out;
  EXPECT_NE(second.out.find("resumed from"), std::string::npos) << second.out;
  auto a = metrics(dir + "_full.json")["steps"];
  auto b = metrics(dir + "_b.json")["steps"];
  ASSERT_EQ(b.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(b[i]["step"], a[i + 3]["step"]);
    EXPECT_EQ(b[i]["loss"].get<double>(), a[i + 3]["loss"].get<double>()) << "step " << i + 4;
  }
}

TEST(HpTrain, ResumeContinuesTheExactTrajectory) {
  expect_exact_resume("cp", "--nproc 2 --cp 2");
}

// HSDP: each rank saves its shards and their optimizer state; another layout is refused.
TEST(HpTrain, ShardedCheckpointsResumeUnderHsdp) {
  expect_exact_resume("hsdp", "--nproc 4 --dp-shard 2 --dp-replicate 2 --comm-fusion on");
  const std::string dir = ::testing::TempDir() + "/hp_train_ckpt_hsdp";
  auto r = run("--nproc 4 --dp-shard 4 --steps 6 --checkpoint-dir " + dir + " --resume");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("was written by another layout or model"), std::string::npos) << r.out;
}

// HSDP with CP inside the shard group, accumulation and recompute: the single-process run on
// the union of the data agrees.
TEST(HpTrain, HsdpValidatesAgainstTheSingleProcessRun) {
  const std::string m = ::testing::TempDir() + "/train_hsdp.json";
  auto r =
      run("--nproc 4 --dp-replicate 2 --cp 2 --cp-algo all_gather --load-balance --grad-accum 2 "
          "--recompute --steps 4 --seq-len 64 --validate --metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(m);
  EXPECT_LT(j["validate"]["max_abs_loss_diff"].get<double>(), 1e-4);
  EXPECT_LT(j["validate"]["max_rel_grad_diff"].get<double>(), 1e-4);
  EXPECT_GT(j["comm_bytes_per_step"]["reduce_scatter"].get<int64_t>(), 0);
  EXPECT_GT(j["comm_bytes_per_step"]["all_reduce"].get<int64_t>(), 0);
  EXPECT_NE(r.out.find("fully_shard: HSDP (R=2, Sd=2)"), std::string::npos) << r.out;
}

TEST(HpTrain, ConfigFileAndTrace) {
  const std::string dir = ::testing::TempDir();
  {
    std::ofstream f(dir + "/train_cfg.json");
    f << R"({"cp": 2, "cp_algo": "hybrid", "steps": 2, "seq_len": 64, "load_balance": false})";
  }
  // The command line wins over the file: --cp-algo all_gather replaces "hybrid".
  auto r = run("--nproc 2 --config " + dir + "/train_cfg.json --cp-algo all_gather --trace " + dir +
               "/train_trace.json --metrics-json " + dir + "/train_cfg_m.json");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(dir + "/train_cfg_m.json");
  EXPECT_EQ(j["config"]["cp"], 2);
  EXPECT_EQ(j["config"]["seq_len"], 64);
  EXPECT_EQ(j["config"]["cp_algo"], "all_gather");
  std::ifstream t(dir + "/train_trace.json");
  auto trace = nlohmann::json::parse(t);
  std::set<int> ranks;
  for (const auto& e : trace["traceEvents"])
    ranks.insert(e["pid"].get<int>());
  EXPECT_EQ(ranks, (std::set<int>{0, 1}));
  auto bad = run("--nproc 2 --config " + dir + "/train_cfg.json --cp 2 --nonsense 1");
  EXPECT_NE(bad.rc, 0);
}

TEST(HpTrain, TrainsOnTextAndTokenFiles) {
  const std::string dir = ::testing::TempDir();
  {
    std::ofstream t(dir + "/corpus.txt");
    for (int i = 0; i < 200; ++i)
      t << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  auto txt = run("--nproc 2 --cp 2 --data " + dir +
                 "/corpus.txt --vocab 256 --seq-len 64 "
                 "--steps 2");
  EXPECT_EQ(txt.rc, 0) << txt.out;
  {
    std::ofstream b(dir + "/tokens.bin", std::ios::binary);
    for (uint32_t i = 0; i < 4096; ++i) {
      const uint32_t id = (i * 7) % 300;
      b.write(reinterpret_cast<const char*>(&id), 4);
    }
  }
  auto bin = run("--nproc 2 --cp 2 --data " + dir +
                 "/tokens.bin --data-dtype uint32 "
                 "--vocab 300 --seq-len 64 --steps 2");
  EXPECT_EQ(bin.rc, 0) << bin.out;
  auto small_vocab = run("--nproc 2 --cp 2 --data " + dir +
                         "/tokens.bin --data-dtype uint32 "
                         "--vocab 100 --seq-len 64 --steps 2");
  EXPECT_NE(small_vocab.rc, 0);
  EXPECT_NE(small_vocab.out.find("holds token ids up to 299 but --vocab is 100"), std::string::npos)
      << small_vocab.out;
}

TEST(HpTrain, InterruptStopsEveryRank) {
  // A long run, interrupted: the launcher stops both ranks and exits 128 + SIGINT.
  const std::string marker = "--seed 918273";
  const std::string cmd = std::string(HP_TRAIN_BINARY) + " --nproc 2 --cp 2 --steps 100000 " +
                          marker + " > /dev/null 2>&1 & echo $!";
  FILE* p = ::popen(cmd.c_str(), "r");
  int pid = 0;
  ASSERT_EQ(std::fscanf(p, "%d", &pid), 1);
  ::pclose(p);
  std::this_thread::sleep_for(std::chrono::seconds(4));
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  for (int i = 0; i < 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (::kill(pid, 0) != 0) break;  // gone (reaped by the shell's parent, i.e. init)
  }
  (void)status;
  EXPECT_NE(::kill(pid, 0), 0) << "the launcher did not exit";
  // No rank survives: no process carries the marker any more.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int survivors = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    std::ifstream f(e.path() / "cmdline");
    std::string c((std::istreambuf_iterator<char>(f)), {});
    for (auto& ch : c)
      ch = ch == '\0' ? ' ' : ch;
    if (c.find("hp-train") != std::string::npos && c.find("918273") != std::string::npos) {
      ++survivors;
    }
  }
  EXPECT_EQ(survivors, 0);
}

TEST(HpTrain, BadLayoutsFailBeforeAnyCollective) {
  auto r = run("--nproc 4 --tp 3 --cp 1");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--nproc 4 but --dp-replicate 1 x --dp-shard 1 x --cp 1 x --tp 3 = 3"),
            std::string::npos)
      << r.out;
  r = run("--nproc 4 --dp-shard 2 --comm-fusion maybe");
  EXPECT_NE(r.out.find("--comm-fusion 'maybe' is not valid; valid: on, off"), std::string::npos)
      << r.out;
  r = run("--nproc 2 --tp 2 --heads 3 --kv-heads 3");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("heads=3 and kv_heads=3 must both be divisible by tp_size=2"),
            std::string::npos)
      << r.out;
  r = run("--nproc 2 --cp 2 --seq-len 30 --cp-algo all_gather --load-balance");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("sequence length 30 is not divisible by 4 (2 * cp_size, load balance)"),
            std::string::npos)
      << r.out;
  r = run("--nproc 2 --cp 2 --cp-algo ulysses --kv-heads 1 --heads 4");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("key/value heads = 1 are not divisible by the Ulysses degree 2"),
            std::string::npos)
      << r.out;
}

}  // namespace
