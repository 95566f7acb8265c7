// hp-train end to end: the loss falls on the embedded task; --validate agrees with the
// single-process run; resume continues the exact trajectory (bitwise); bad layouts fail
// before any collective with a clear message.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "calibration_file.h"
#include "hp_train_util.h"
#include "rank_harness.h"

namespace {

using namespace hp::train_testing;

// CP bytes one rank sends per training step (forward + backward of every layer), from the
// run's configuration (heads after TP): the formulas of DESIGN 5.2, written out here.
int64_t cp_bytes_per_step(const nlohmann::json& config, const std::string& op) {
  const int64_t layers = config["layers"], batch = config["batch"], s = config["seq_len"],
                p = config["cp"], tp = config["tp"], d = config["head_dim"];
  const int64_t h = config["heads"].get<int64_t>() / tp * d;
  const int64_t hkv = config["kv_heads"].get<int64_t>() / tp * d;
  const int64_t e = 4 * batch;  // fp32, every sequence of the rank's batch
  if (op == "all_to_all") return layers * 2 * (2 * h + 2 * hkv) * (s / p) * e * (p - 1) / p;
  return layers * 2 * (s / p) * hkv * e * (p - 1);  // all_gather of K and V (= reduce_scatter)
}

TEST(HpTrain, LearnsTheCopyTaskAndValidates) {
  const std::string m = hp::testing::scratch_dir() + "/train_metrics.json";
  auto r =
      run("--nproc 2 --cp 2 --cp-algo ulysses --schedule async --steps 120 --validate "
          "--metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(m);
  const auto loss = losses(j, 120);
  ASSERT_EQ(loss.size(), 120u);
  // The copy task's second half is predictable only from the first half, which sits on the other
  // CP rank: without attention across the shards the loss stays near ln(vocab - 1) = 2.7.
  EXPECT_GT(loss.front(), std::log(15.0)) << "an untrained model starts at chance or above";
  EXPECT_LT(loss.back(), 0.05) << r.out;
  double tail = 0;
  for (size_t i = 110; i < 120; ++i)
    tail += loss[i] / 10;
  EXPECT_LT(tail, 0.05) << "the last ten steps stay learned";
  expect_validated(r.out, j, 120, 1e-4);
  const auto& cp_bytes = j["comm_bytes_per_step_by_group"]["cp"];
  EXPECT_EQ(cp_bytes["all_to_all"].get<int64_t>(), cp_bytes_per_step(j["config"], "all_to_all"));
  EXPECT_FALSE(cp_bytes.contains("all_gather")) << cp_bytes;
  // HSDP over the CP ranks (no data parallelism): their gradients are reduced.
  EXPECT_GT(j["comm_bytes_per_step_by_group"]["dp_shard+cp"]["reduce_scatter"].get<int64_t>(), 0);
  for (int layer : {0, 1}) {
    EXPECT_NE(r.out.find("CP inner-wrap: module=layers." + std::to_string(layer) +
                         ".self_attn adapter=sdpa_hf strategy=ulysses schedule=async"),
              std::string::npos)
        << r.out;
  }
  char done[96];
  std::snprintf(done, sizeof(done), "hp-train: done: loss %.4f -> %.4f over 120 steps",
                loss.front(), loss.back());
  EXPECT_NE(r.out.find(done), std::string::npos) << done << "\n" << r.out;
}

// --cp-algo auto ranks every legal strategy and schedule with each strategy's defaults: a choice
// made for it on the command line is refused before any rank starts, naming each flag; the
// metrics record what ran (the cost model's choice, from a calibration file written here).
TEST(HpTrain, CPAutoRefusesTheChoicesItMakesAndRecordsWhatRan) {
  const std::string dir = hp::testing::scratch_dir();
  auto bad =
      run("--nproc 2 --cp 2 --cp-algo auto --schedule async --ulysses-head-groups 2 --steps 1");
  EXPECT_NE(bad.rc, 0) << bad.out;
  EXPECT_NE(bad.out.find("--cp-algo auto chooses the strategy, its schedule and its Ulysses degree "
                         "with each strategy's defaults, so --schedule async, "
                         "--ulysses-head-groups 2 would not run; drop them or name the strategy"),
            std::string::npos)
      << bad.out;
  EXPECT_EQ(bad.out.find("hp-train: done"), std::string::npos) << bad.out;

  const std::string cal_path = dir + "/auto_calibration.json", m = dir + "/auto_metrics.json";
  hp::testing::write_uniform_calibration(cal_path);
  auto r =
      hp::testing::run_command("HP_CALIBRATION=" + cal_path + " " + HP_TRAIN_BINARY +
                               " --nproc 2 --cp 2 --cp-algo auto --steps 2 --metrics-json " + m);
  ASSERT_EQ(r.rc, 0) << r.out;
  const std::string tag = "cp auto: chose ";
  const auto at = r.out.find(tag);
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string chosen = r.out.substr(at + tag.size(), r.out.find('\n', at) - at - tag.size());
  const auto config = metrics(m)["config"];
  EXPECT_EQ(config["cp_algo"], "auto");
  const std::string strategy = config["cp_strategy"], schedule = config["schedule"];
  EXPECT_EQ(chosen.rfind(strategy, 0), 0u) << chosen << " against " << config;
  EXPECT_EQ(chosen.substr(chosen.size() - schedule.size() - 1), "/" + schedule)
      << chosen << " against " << config;
  EXPECT_EQ(config["ulysses_degree"], strategy == "ulysses" ? 2 : 1) << config;
  EXPECT_EQ(config["kv_head_policy"], "error") << config;

  // One K/V head over 2 ranks: --kv-head-policy repeat lets the Ulysses candidates in (their
  // predictions are logged), and the metrics record the policy only where it repeats.
  const std::string gqa = "--heads 4 --kv-heads 1 --head-dim 8 --hidden 32 --ffn 48 --layers 1 ";
  r = hp::testing::run_command(
      "HP_CALIBRATION=" + cal_path + " " + HP_TRAIN_BINARY +
      " --nproc 2 --cp 2 --cp-algo auto --kv-head-policy repeat --steps 1 " + gqa +
      "--metrics-json " + m);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("predicted ulysses/sync:"), std::string::npos) << r.out;
  const auto repeat = metrics(m)["config"];
  EXPECT_EQ(repeat["kv_head_policy"], repeat["cp_strategy"] == "ulysses" ? "repeat" : "error")
      << repeat;
}

// TP and CP both at work: the single-process run agrees, and the CP collectives move the K/V
// of the TP-local heads (kv_heads / tp), as the formula says.
TEST(HpTrain, TensorAndContextParallelTogether) {
  const std::string m = hp::testing::scratch_dir() + "/train_tpcp.json";
  auto r =
      run("--nproc 4 --tp 2 --cp 2 --cp-algo all_gather --load-balance --steps 3 "
          "--validate --metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(m);
  losses(j, 3);
  expect_validated(r.out, j, 3, 1e-4);
  EXPECT_NE(j["config"]["plan"].get<std::string>().find(
                "mesh (dp_replicate=1, dp_shard=1, cp=2, tp=2) cp: algorithm=all_gather"),
            std::string::npos)
      << j["config"]["plan"];
  EXPECT_NE(r.out.find("strategy=all_gather schedule=sync cp_size=2 ulysses_degree=1 "
                       "colossal_degree=2 load_balance=data_order"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(j["steps"][0].contains("index_loss")) << "no DSA layer, no indexer loss";
  const auto& cp_bytes = j["comm_bytes_per_step_by_group"]["cp"];
  EXPECT_EQ(cp_bytes["all_gather"].get<int64_t>(), cp_bytes_per_step(j["config"], "all_gather"));
  EXPECT_EQ(cp_bytes["reduce_scatter"].get<int64_t>(),
            cp_bytes_per_step(j["config"], "all_gather"));
}

// Runs `common` alone and with `extra`; both succeed and their first `steps` losses and
// gradient norms are equal, bitwise. Returns the two outputs.
std::pair<std::string, std::string> expect_same_steps(const std::string& common,
                                                      const std::string& extra,
                                                      const std::string& name, size_t steps) {
  const std::string base = hp::testing::scratch_dir() + "/" + name;
  auto a = run(common + " --metrics-json " + base + "_a.json");
  auto b = run(common + " " + extra + " --metrics-json " + base + "_b.json");
  EXPECT_EQ(a.rc, 0) << a.out;
  EXPECT_EQ(b.rc, 0) << b.out;
  if (a.rc != 0 || b.rc != 0) return {a.out, b.out};
  auto ma = metrics(base + "_a.json"), mb = metrics(base + "_b.json");
  EXPECT_EQ(losses(ma, steps), losses(mb, steps));
  for (size_t i = 0; i < steps; ++i) {
    EXPECT_EQ(ma["steps"][i]["grad_norm"].get<double>(), mb["steps"][i]["grad_norm"].get<double>())
        << "step " << i + 1;
  }
  return {a.out, b.out};
}

TEST(HpTrain, ValidateModeEqualsProductionBitwise) {
  const auto [p, v] = expect_same_steps("--nproc 4 --tp 2 --cp 2 --steps 3 --heads 8 --kv-heads 4",
                                        "--mode validate", "mode", 3);
  EXPECT_NE(p.find("(production mode)"), std::string::npos) << p;
  EXPECT_NE(v.find("(validate mode)"), std::string::npos) << v;
  // Under HSDP and with recompute the layers' outputs and recomputed inputs are new tensors of
  // the same values; they keep their layouts (validate mode refused every HSDP layout before).
  expect_same_steps("--nproc 2 --dp-shard 2 --steps 2", "--mode validate", "mode_hsdp", 2);
  expect_same_steps("--nproc 2 --dp-replicate 2 --recompute --steps 2", "--mode validate",
                    "mode_recompute", 2);
}

// The caching host allocator (the default) changes where tensors live, never what is computed:
// the same run under LibTorch's own allocator gives the same losses and gradient norms, bitwise.
TEST(HpTrain, HostAllocatorChoiceChangesNoResult) {
  const std::string common = "--nproc 2 --cp 2 --steps 3 --heads 4 --kv-heads 2";
  expect_same_steps(common, "--host-allocator system", "alloc", 3);
  auto bad = run(common + " --host-allocator jemalloc");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("--host-allocator"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("caching"), std::string::npos) << bad.out;
}

// 6 steps in one run equal 3 steps + resume + 3 steps, bitwise, for `layout`: the losses, the
// gradient norms and the learning rates of every step.
void expect_exact_resume(const std::string& name, const std::string& layout, int ranks) {
  namespace fs = std::filesystem;
  const std::string dir = hp::testing::scratch_dir() + "/hp_train_ckpt_" + name;
  fs::remove_all(dir);
  const std::string common = layout + " --steps 6 ";
  auto full = run(common + "--metrics-json " + dir + "_full.json");
  ASSERT_EQ(full.rc, 0) << full.out;
  auto first = run(layout + " --steps 3 --checkpoint-every 3 --checkpoint-dir " + dir +
                   " --metrics-json " + dir + "_a.json");
  ASSERT_EQ(first.rc, 0) << first.out;
  const std::string step3 = dir + "/step_00000003";
  ASSERT_TRUE(fs::exists(step3 + "/manifest.json"));
  auto manifest = metrics(step3 + "/manifest.json");
  EXPECT_EQ(manifest["step"], 3);
  EXPECT_EQ(manifest["world_size"], ranks);
  for (int r = 0; r < ranks; ++r) {  // every rank wrote its part
    for (const char* part : {"model", "optim"}) {
      const std::string f = step3 + "/rank" + std::to_string(r) + "." + part + ".pt";
      EXPECT_TRUE(fs::exists(f) && fs::file_size(f) > 0) << f;
    }
  }
  auto second =
      run(common + "--checkpoint-dir " + dir + " --resume --metrics-json " + dir + "_b.json");
  ASSERT_EQ(second.rc, 0) << second.out;
  EXPECT_NE(second.out.find("hp-train: resumed from " + step3), std::string::npos) << second.out;
  auto f = metrics(dir + "_full.json");
  auto a = metrics(dir + "_a.json");
  auto b = metrics(dir + "_b.json");
  const auto lf = losses(f, 6), la = losses(a, 3), lb = losses(b, 3, 4);
  ASSERT_EQ(lf.size(), 6u);
  // The first 3 steps are the same run; then the resumed run continues the trajectory exactly.
  EXPECT_EQ(la, std::vector<double>(lf.begin(), lf.begin() + 3));
  EXPECT_EQ(lb, std::vector<double>(lf.begin() + 3, lf.end()));
  for (int i = 0; i < 3; ++i) {
    const auto &sb = b["steps"][i], &sf = f["steps"][i + 3];
    EXPECT_EQ(sb["grad_norm"].get<double>(), sf["grad_norm"].get<double>()) << "step " << i + 4;
    EXPECT_EQ(sb["lr"].get<double>(), sf["lr"].get<double>()) << "step " << i + 4;
  }
  // Not a run that merely repeats itself: the resumed steps train on.
  EXPECT_NE(lf[3], lf[0]);
}

TEST(HpTrain, ResumeContinuesTheExactTrajectory) {
  expect_exact_resume("cp", "--nproc 2 --cp 2", 2);
}

// HSDP: each rank saves its shards and their optimizer state; another layout is refused.
TEST(HpTrain, ShardedCheckpointsResumeUnderHsdp) {
  expect_exact_resume("hsdp", "--nproc 4 --dp-shard 2 --dp-replicate 2 --comm-fusion on", 4);
  const std::string dir = hp::testing::scratch_dir() + "/hp_train_ckpt_hsdp";
  auto r = run("--nproc 4 --dp-shard 4 --steps 6 --checkpoint-dir " + dir + " --resume");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("hp-train --resume: checkpoint '" + dir +
                       "/step_00000006' was written by another layout or model"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("  step "), std::string::npos) << "no step may run: " << r.out;
}

// HSDP with CP inside the shard group, accumulation and recompute: the single-process run on
// the union of the data agrees.
TEST(HpTrain, HsdpValidatesAgainstTheSingleProcessRun) {
  const std::string m = hp::testing::scratch_dir() + "/train_hsdp.json";
  auto r =
      run("--nproc 4 --dp-replicate 2 --cp 2 --cp-algo all_gather --load-balance --grad-accum 2 "
          "--recompute --steps 4 --seq-len 64 --validate --metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(m);
  losses(j, 4);
  expect_validated(r.out, j, 4, 1e-4);
  EXPECT_GT(j["comm_bytes_per_step"]["reduce_scatter"].get<int64_t>(), 0);
  EXPECT_GT(j["comm_bytes_per_step"]["all_reduce"].get<int64_t>(), 0);
  EXPECT_NE(r.out.find("fully_shard: HSDP (R=2, Sd=2)"), std::string::npos) << r.out;
}

TEST(HpTrain, ConfigFileAndTrace) {
  const std::string dir = hp::testing::scratch_dir();
  {
    std::ofstream f(dir + "/train_cfg.json");
    f << R"({"cp": 2, "cp_algo": "hybrid", "steps": 2, "seq_len": 64, "load_balance": false})";
  }
  // The command line wins over the file: --cp-algo all_gather replaces "hybrid".
  const std::string trace_path = dir + "/train_trace.json";
  std::filesystem::remove(trace_path);
  auto r = run("--nproc 2 --config " + dir + "/train_cfg.json --cp-algo all_gather --trace " +
               trace_path + " --metrics-json " + dir + "/train_cfg_m.json");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = metrics(dir + "/train_cfg_m.json");
  EXPECT_EQ(j["config"]["cp"], 2);
  EXPECT_EQ(j["config"]["seq_len"], 64);
  EXPECT_EQ(j["config"]["cp_algo"], "all_gather");
  losses(j, 2);  // "steps": 2 from the file
  // What ran, not only what was recorded: all_gather from the command line, S = 64 from the file.
  EXPECT_NE(r.out.find("strategy=all_gather schedule=sync cp_size=2"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("strategy=hybrid"), std::string::npos) << r.out;

  // The trace: valid JSON, one named track per rank, and per rank the CP collectives of every
  // step (K and V gathered per layer in forward, reduce-scattered in backward) on group 'cp',
  // each with the wait that closed it; their bytes add up to the run's per-step counts. HSDP's
  // gathers of the parameters and reductions of their gradients run on 'dp_shard+cp'.
  std::ifstream t(trace_path);
  ASSERT_TRUE(t.good()) << trace_path;
  auto trace = nlohmann::json::parse(t);
  std::map<int, std::string> names;
  std::map<int, std::map<std::string, int>> count;
  std::map<int, std::map<std::string, int64_t>> bytes;
  std::map<int, std::map<std::string, int>> hsdp_count;
  std::vector<std::string> malformed;  // events that break the format, reported once
  for (const auto& e : trace.at("traceEvents")) {
    const int pid = e.at("pid").get<int>();
    const auto args = e.value("args", nlohmann::json::object());
    if (e.value("ph", "") == "M" && e.value("name", "") == "process_name") {
      names[pid] = args.value("name", "");
      continue;
    }
    const std::string name = e.value("name", ""), cat = e.value("cat", "");
    const int64_t b = args.value("bytes", int64_t{-1});
    const bool comm = cat == "comm";
    // CP attention calls and their backward
    const bool compute = cat == "compute" && (name == "attention" || name == "attention_backward");
    const bool ok = e.value("ph", "") == "X" && e.value("ts", int64_t{0}) > 0 &&
                    e.value("dur", int64_t{-1}) >= 0 &&
                    (compute || ((comm || cat == "comm_wait") && (!comm || b > 0) &&
                                 !args.value("group", "").empty()));
    if (!ok) malformed.push_back(e.dump());
    const std::string group = args.value("group", "");
    if (group == "dp_shard+cp") {
      ++hsdp_count[pid][name];
      continue;
    }
    ++count[pid][name];
    if (comm) bytes[pid][name] += b;
    if (name == "all_gather" || name == "reduce_scatter") {
      if (group != "cp") malformed.push_back(e.dump());
    }
  }
  EXPECT_TRUE(malformed.empty()) << malformed.size() << " malformed events, e.g. "
                                 << (malformed.empty() ? "" : malformed.front());
  EXPECT_EQ(names, (std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}}));
  const int per_step = 2 * j["config"]["layers"].get<int>();  // K and V per layer
  for (int rank : {0, 1}) {
    for (const char* op : {"all_gather", "reduce_scatter"}) {
      EXPECT_EQ(count[rank][op], 2 * per_step) << "rank " << rank << " " << op;
      EXPECT_EQ(count[rank][std::string("wait ") + op], count[rank][op]) << "rank " << rank;
      EXPECT_EQ(bytes[rank][op], 2 * j["comm_bytes_per_step_by_group"]["cp"][op].get<int64_t>())
          << "rank " << rank << " " << op;
      EXPECT_GT(hsdp_count[rank][op], 0) << "rank " << rank << " " << op;
    }
    EXPECT_GT(count[rank]["all_reduce"], 0) << "rank " << rank;
    // One attention call per layer and step (sync all_gather: one query part), and its backward.
    EXPECT_EQ(count[rank]["attention"], per_step) << "rank " << rank;
    EXPECT_EQ(count[rank]["attention_backward"], per_step) << "rank " << rank;
  }
  EXPECT_EQ(count[0], count[1]) << "both ranks issue the same collectives";

  auto bad = run("--nproc 2 --config " + dir + "/train_cfg.json --cp 2 --nonsense 1");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("The following arguments were not expected"), std::string::npos)
      << bad.out;
  EXPECT_NE(bad.out.find("--nonsense"), std::string::npos) << bad.out;
  // --cp-mode and --linear-cp-mode name one option: a file holding both is refused.
  {
    std::ofstream f(dir + "/train_cfg_modes.json");
    f << R"({"mixer": "gdn", "cp_mode": "ulysses", "linear_cp_mode": "state_passing"})";
  }
  auto modes = run("--nproc 1 --config " + dir + "/train_cfg_modes.json");
  EXPECT_EQ(modes.rc, 1) << modes.out;
  EXPECT_NE(modes.out.find("sets both cp_mode and linear_cp_mode, the same option"),
            std::string::npos)
      << modes.out;
}

// The data files are read (ids checked against --vocab) and learned from: finite losses that fall.
TEST(HpTrain, TrainsOnTextAndTokenFiles) {
  const std::string dir = hp::testing::scratch_dir();
  {
    std::ofstream t(dir + "/corpus.txt");
    for (int i = 0; i < 200; ++i)
      t << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  auto txt = run("--nproc 2 --cp 2 --data " + dir +
                 "/corpus.txt --vocab 256 --seq-len 64 --steps 10 --metrics-json " + dir +
                 "/train_txt.json");
  ASSERT_EQ(txt.rc, 0) << txt.out;
  auto jt = metrics(dir + "/train_txt.json");
  EXPECT_EQ(jt["config"]["data"], dir + "/corpus.txt");
  const auto lt = losses(jt, 10);
  ASSERT_EQ(lt.size(), 10u);
  EXPECT_LT(lt.back(), 0.6 * lt.front()) << txt.out;
  {
    std::ofstream b(dir + "/tokens.bin", std::ios::binary);
    for (uint32_t i = 0; i < 4096; ++i) {
      const uint32_t id = (i * 7) % 300;
      b.write(reinterpret_cast<const char*>(&id), 4);
    }
  }
  auto bin = run("--nproc 2 --cp 2 --data " + dir +
                 "/tokens.bin --data-dtype uint32 "
                 "--vocab 300 --seq-len 64 --steps 10 --metrics-json " +
                 dir + "/train_bin.json");
  ASSERT_EQ(bin.rc, 0) << bin.out;
  auto jb = metrics(dir + "/train_bin.json");
  EXPECT_EQ(jb["config"]["data"], dir + "/tokens.bin");
  const auto lb = losses(jb, 10);
  ASSERT_EQ(lb.size(), 10u);
  EXPECT_LT(lb.back(), 0.8 * lb.front()) << bin.out;
  auto small_vocab = run("--nproc 2 --cp 2 --data " + dir +
                         "/tokens.bin --data-dtype uint32 "
                         "--vocab 100 --seq-len 64 --steps 2");
  EXPECT_EQ(small_vocab.rc, 1);
  EXPECT_NE(small_vocab.out.find("holds token ids up to 299 but --vocab is 100"), std::string::npos)
      << small_vocab.out;
}

// The processes whose parent is `pid` (from /proc/<child>/stat).
std::vector<int> children_of(int pid) {
  std::vector<int> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(f)), {});
    const auto close = stat.rfind(')');  // "pid (comm) state ppid ..."
    if (close == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) == 2 && ppid == pid &&
        state != 'Z') {
      out.push_back(std::stoi(name));
    }
  }
  return out;
}

bool alive(int pid) {
  return ::kill(pid, 0) == 0 || errno != ESRCH;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

TEST(HpTrain, InterruptStopsEveryRank) {
  // A long run, interrupted once both ranks train: the launcher stops both ranks, says so and
  // exits 128 + SIGINT.
  const std::string log = hp::testing::scratch_dir() + "/train_interrupt.log";
  std::vector<std::string> args{HP_TRAIN_BINARY, "--nproc", "2",      "--cp",  "2",
                                "--steps",       "100000",  "--seed", "918273"};
  std::vector<char*> argv;
  for (auto& a : args)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  std::filesystem::remove(log);  // read below before the child has truncated it otherwise
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  // Wait until rank 0 reports its first step: both ranks are then up and training.
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (read_file(log).find("  step 1/100000") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    ASSERT_EQ(::waitpid(pid, &status, WNOHANG), 0) << "hp-train ended before the interrupt:\n"
                                                   << read_file(log);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto ranks = children_of(pid);
  EXPECT_EQ(ranks.size(), 2u) << read_file(log);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  pid_t waited = 0;
  for (int i = 0; i < 300 && waited == 0; ++i) {  // up to 15 s
    waited = ::waitpid(pid, &status, WNOHANG);
    if (waited == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (waited == 0) {  // do not leave it behind
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    ADD_FAILURE() << "the launcher did not exit after SIGINT";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGINT)
      << "status " << status << "\n"
      << read_file(log);
  EXPECT_NE(read_file(log).find("hp-train: interrupted by signal 2; stopped all ranks"),
            std::string::npos)
      << read_file(log);
  // No rank survives its launcher (a survivor still runs this test's command line; only such a
  // process is cleaned up, never one that merely reuses the pid).
  for (int r : ranks) {
    const std::string cmdline = read_file("/proc/" + std::to_string(r) + "/cmdline");
    const bool survivor = alive(r) && cmdline.find("918273") != std::string::npos;
    EXPECT_FALSE(survivor) << "rank process " << r << " is still alive";
    if (survivor) ::kill(r, SIGKILL);
  }
}

// Each bad layout fails with its own message, from the static checks: no plan is printed (the
// plan line follows the mesh and the CP installation) and no collective is named.
TEST(HpTrain, BadLayoutsFailBeforeAnyCollective) {
  expect_refused("--nproc 2 --cp 2 --cp-algo ring --kv-head-policy repeat",
                 {"cp_config.kv_head_policy=repeat applies to algorithm=ulysses, hybrid or usp "
                  "(got ring"});
  // Refused by the launcher, before any rank starts.
  expect_refused("--nproc 4 --tp 3 --cp 1",
                 {"--nproc 4 but --dp-replicate 1 x --dp-shard 1 x --cp 1 x --tp 3 = 3"});
  expect_refused("--nproc 4 --dp-shard 2 --comm-fusion maybe",
                 {"--comm-fusion 'maybe' is not valid; valid: on, off"});
  // Flags that would do nothing in the run they are given to.
  expect_refused("--nproc 1 --value-heads 8",
                 {"--value-heads 8 sizes linear-attention layers (--mixer gdn|kda, or L in a layer "
                  "pattern), but with --mixer attention there are none"});
  expect_refused("--nproc 1 --mixer gdn --kv-rank 32", {"--kv-rank and --q-rank size MLA/DSA"});
  expect_refused("--nproc 1 --attention mla --partial-rotary-factor 0.5",
                 {"--partial-rotary-factor 0.5 applies to softmax attention layers, but with "
                  "--attention mla there are none"});
  expect_refused("--nproc 1 --comm-fusion on",
                 {"--comm-fusion on fuses HSDP's gradient reduce-scatters, but --dp-shard 1 x "
                  "--dp-replicate 1 x --cp 1 x --tp 1 = 1 rank runs no HSDP"});
  expect_refused("--nproc 1 --checkpoint-every 2", {"--checkpoint-every 2 needs --checkpoint-dir"});
  expect_refused("--nproc 1 --data-dtype uint32",
                 {"--data-dtype uint32 is the token width of a .bin --data file, but --data is "
                  "not given"});
  expect_refused("--nproc 2 --cp 2 --attention mla --kv-head-policy repeat --ring-keep-blocks",
                 {"--kv-head-policy repeat, --ring-keep-blocks tune softmax attention's CP, but "
                  "with --attention mla no layer has softmax attention"});
  expect_refused("--nproc 2 --cp 2 --mixer gdn --cp-mode ulysses --state-exchange p2p",
                 {"plan: state_exchange 'p2p' chooses how linear CP mode state_passing folds its "
                  "states; mode ulysses exchanges none"});
  expect_refused("--nproc 1 --mixer gdn --cp-mode ulysses --linear-cp-mode state_passing",
                 {"--cp-mode and --linear-cp-mode are the same option"});
  // CP flags without CP (--cp 1, the default) would do nothing.
  expect_refused("--nproc 2 --tp 2 --cp-algo ring --schedule async --ring-keep-blocks",
                 {"hp-train: --cp-algo ring, --schedule async, --ring-keep-blocks configure "
                  "context parallelism, but --cp is 1 (no CP runs); drop them or set --cp > 1"});
  // Refused by the planner, run by the launcher before any rank starts: printed once.
  for (const auto& [args, text] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc 2 --tp 2 --heads 3 --kv-heads 3",
            "heads=3 and kv_heads=3 must both be divisible by tp_size=2"},
           {"--nproc 2 --cp 2 --seq-len 30 --cp-algo all_gather --load-balance",
            "sequence length 30 is not divisible by 4 (2 * cp_size, load balance)"},
           {"--nproc 2 --cp 2 --cp-algo ulysses --kv-heads 1 --heads 4",
            "key/value heads = 1 are not divisible by the Ulysses degree 2"}}) {
    expect_refused(args, {text});
    const auto out = run(args).out;
    const auto first = out.find(text);
    EXPECT_EQ(out.find(text, first + 1), std::string::npos) << "printed more than once:\n" << out;
    EXPECT_EQ(out.find("exited with code"), std::string::npos) << "a rank started:\n" << out;
  }
}

}  // namespace
