// hp-train under faults and bad input (issue 13): damaged checkpoints fail naming the file and
// the rank; a non-finite loss stops the run (or skips its step) and keeps the last good
// checkpoint; output paths, options and memory are checked before step 1; checkpoint and resume
// edge cases; every file error names its file. Tiny runs: each command takes a second or two.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace {
namespace fs = std::filesystem;

hp::testing::CommandResult run(const std::string& args, const std::string& env = "") {
  return hp::testing::run_command(env + " " + std::string(HP_TRAIN_BINARY) + " " + args);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

bool contains(const std::string& out, const std::string& text) {
  return out.find(text) != std::string::npos;
}

// A fresh directory under the scratch dir.
std::string fresh(const std::string& name) {
  const std::string dir = hp::testing::scratch_dir() + "/" + name;
  fs::remove_all(dir);
  return dir;
}

// Two CP ranks on the embedded task, short sequences: about a second per run.
const std::string kTiny = "--nproc 2 --cp 2 --seq-len 32 ";

// The step directories under a checkpoint root, sorted.
std::vector<std::string> step_dirs(const std::string& root) {
  std::vector<std::string> out;
  if (!fs::exists(root)) return out;
  for (const auto& e : fs::directory_iterator(root))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// ---- 1. damaged checkpoints ----

TEST(HpTrainReliability, DamagedCheckpointFilesFailNamingFileAndRank) {
  const std::string good = fresh("ckpt_good");
  auto w = run(kTiny + "--steps 2 --checkpoint-every 2 --checkpoint-dir " + good);
  ASSERT_EQ(w.rc, 0) << w.out;
  const std::string step = "/step_00000002";
  auto manifest = read_json(good + step + "/manifest.json");
  // Every file of the step is recorded with its size and CRC, and each rank's tensors.
  ASSERT_TRUE(manifest.contains("ranks")) << manifest.dump(2);
  ASSERT_EQ(manifest["ranks"].size(), 2u) << manifest.dump(2);
  for (int r = 0; r < 2; ++r) {
    const auto& rec = manifest["ranks"][r];
    EXPECT_EQ(rec["rank"], r);
    for (const char* part : {"model", "optim"}) {
      const std::string name = "rank" + std::to_string(r) + "." + part + ".pt";
      ASSERT_TRUE(rec["files"].contains(name)) << rec.dump(2);
      EXPECT_EQ(rec["files"][name]["bytes"].get<int64_t>(),
                static_cast<int64_t>(fs::file_size(good + step + "/" + name)));
      EXPECT_EQ(rec["files"][name]["crc32"].get<std::string>().size(), 10u);
    }
    ASSERT_FALSE(rec["tensors"].empty());
    EXPECT_EQ(rec["tensors"][0]["name"], "embed_tokens");
    EXPECT_EQ(rec["tensors"][0]["shape"], nlohmann::json::array({16, 64}));
    EXPECT_EQ(rec["tensors"][0]["dtype"], "float32");
  }

  // Each damage on its own copy; every resume fails before any step, naming file and rank.
  struct Damage {
    std::string name, file;
    std::function<void(const std::string& path)> apply;
    std::vector<std::string> texts;
  };
  const std::vector<Damage> damages = {
      {"flip",
       "rank1.model.pt",
       [](const std::string& p) {
         auto b = read_bytes(p);
         for (size_t i = 0; i < 4; ++i)
           b[b.size() / 2 + i] = static_cast<char>(b[b.size() / 2 + i] ^ 0x5A);
         write_bytes(p, b);
       },
       {"is damaged: its CRC-32 is 0x", "but the manifest records 0x"}},
      {"truncate",
       "rank1.optim.pt",
       [](const std::string& p) { fs::resize_file(p, fs::file_size(p) / 2); },
       {"bytes but the manifest records", "truncated or replaced"}},
      {"delete", "rank0.model.pt", [](const std::string& p) { fs::remove(p); }, {"is missing"}},
  };
  for (const auto& d : damages) {
    const std::string dir = fresh("ckpt_" + d.name);
    fs::copy(good, dir, fs::copy_options::recursive);
    const std::string path = dir + step + "/" + d.file;
    d.apply(path);
    auto r = run(kTiny + "--steps 4 --checkpoint-dir " + dir + " --resume");
    EXPECT_NE(r.rc, 0) << d.name << "\n" << r.out;
    const std::string rank = d.file.substr(4, 1);
    EXPECT_TRUE(contains(r.out, "rank " + rank + "'s file '" + path + "'")) << d.name << "\n"
                                                                            << r.out;
    for (const auto& t : d.texts)
      EXPECT_TRUE(contains(r.out, t)) << d.name << ": " << t << "\n" << r.out;
    EXPECT_FALSE(contains(r.out, "  step 3/4")) << d.name << ": no step may run\n" << r.out;
  }

  // The manifest's tensor list against this run: a changed shape, a tensor it lacks.
  {
    const std::string dir = fresh("ckpt_shape");
    fs::copy(good, dir, fs::copy_options::recursive);
    auto m = manifest;
    m["ranks"][1]["tensors"][0]["shape"] = {16, 65};
    std::ofstream(dir + step + "/manifest.json") << m.dump(2);
    auto r = run(kTiny + "--steps 4 --checkpoint-dir " + dir + " --resume");
    EXPECT_NE(r.rc, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "rank 1: tensor 'embed_tokens' has shape [16, 65] (float32) in '" +
                                    dir + step + "/rank1.model.pt'"))
        << r.out;
    EXPECT_TRUE(contains(r.out, "this run expects [16, 64] (float32)")) << r.out;
  }
  {
    const std::string dir = fresh("ckpt_missing_tensor");
    fs::copy(good, dir, fs::copy_options::recursive);
    auto m = manifest;
    m["ranks"][0]["tensors"].erase(0);
    std::ofstream(dir + step + "/manifest.json") << m.dump(2);
    auto r = run(kTiny + "--steps 4 --checkpoint-dir " + dir + " --resume");
    EXPECT_NE(r.rc, 0) << r.out;
    EXPECT_TRUE(
        contains(r.out, "rank 0: '" + dir + step + "/rank0.model.pt' has no tensor 'embed_tokens'"))
        << r.out;
  }

  // The intact checkpoint resumes.
  auto ok = run(kTiny + "--steps 3 --checkpoint-dir " + good + " --resume");
  EXPECT_EQ(ok.rc, 0) << ok.out;
  EXPECT_TRUE(contains(ok.out, "hp-train: resumed from " + good + step)) << ok.out;
}

// ---- 2. non-finite loss ----

TEST(HpTrainReliability, NonFiniteLossStopsAndKeepsTheLastGoodCheckpoint) {
  const std::string dir = fresh("ckpt_nan");
  // Rank 1's loss of step 3 is made NaN (the test hook); checkpoints every 2 steps.
  auto r = run(kTiny + "--steps 6 --checkpoint-every 2 --checkpoint-dir " + dir,
               "HP_TEST_NAN_AT_STEP=3 HP_TEST_NAN_RANK=1");
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "hp-train: non-finite loss (nan) at step 3 (first seen on rank 1)"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "the last checkpoint is '" + dir + "/step_00000002'")) << r.out;
  EXPECT_FALSE(contains(r.out, "hp-train: done")) << r.out;
  EXPECT_EQ(step_dirs(dir), std::vector<std::string>{"step_00000002"});
  // The kept checkpoint is good: the run resumes from it (without the fault) and finishes.
  auto resumed =
      run(kTiny + "--steps 4 --checkpoint-every 2 --checkpoint-dir " + dir + " --resume");
  EXPECT_EQ(resumed.rc, 0) << resumed.out;
  EXPECT_TRUE(contains(resumed.out, "resumed from " + dir + "/step_00000002")) << resumed.out;
}

TEST(HpTrainReliability, NanPolicySkipStepSkipsTheUpdateAndContinues) {
  const std::string m = fresh("nan_skip.json");
  auto r = run(kTiny + "--steps 5 --nan-policy skip-step --metrics-json " + m,
               "HP_TEST_NAN_AT_STEP=3 HP_TEST_NAN_RANK=0");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(
      contains(r.out,
               "hp-train: step 3: non-finite loss (nan) (first seen on rank 0); skipped its "
               "optimizer step (--nan-policy skip-step)"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "hp-train: done")) << r.out;
  auto j = read_json(m);
  ASSERT_EQ(j["steps"].size(), 5u);
  EXPECT_TRUE(j["steps"][2]["skipped"].get<bool>());
  for (int i : {0, 1, 3, 4}) {
    EXPECT_FALSE(j["steps"][i]["skipped"].get<bool>()) << i;
    EXPECT_TRUE(std::isfinite(j["steps"][i]["loss"].get<double>())) << i;
  }
  // Before the fault the run is the fault-free one.
  auto clean = run(kTiny + "--steps 2 --metrics-json " + m + ".clean");
  ASSERT_EQ(clean.rc, 0) << clean.out;
  auto c = read_json(m + ".clean");
  EXPECT_EQ(c["steps"][1]["loss"].get<double>(), j["steps"][1]["loss"].get<double>());
  auto bad = run(kTiny + "--steps 2 --nan-policy ignore");
  EXPECT_NE(bad.rc, 0);
  EXPECT_TRUE(contains(bad.out, "--nan-policy 'ignore' is not valid; valid: error, skip-step"))
      << bad.out;
}

// ---- 5. checkpoint interval, resume edge cases ----

TEST(HpTrainReliability, CheckpointDirAloneSavesAtTheEnd) {
  const std::string dir = fresh("ckpt_end");
  auto r = run(kTiny + "--steps 3 --checkpoint-dir " + dir);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(step_dirs(dir), std::vector<std::string>{"step_00000003"});
}

TEST(HpTrainReliability, ResumeWithNothingToResume) {
  const std::string dir = fresh("ckpt_none");
  auto r = run(kTiny + "--steps 2 --checkpoint-dir " + dir + " --resume");
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(
      r.out, "hp-train --resume: nothing to resume: no complete checkpoint under '" + dir + "'"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "--resume-if-exists")) << r.out;
  EXPECT_FALSE(contains(r.out, "  step 1/")) << r.out;
  const std::string m = dir + ".json";
  auto fresh_run =
      run(kTiny + "--steps 2 --checkpoint-dir " + dir + " --resume-if-exists --metrics-json " + m);
  ASSERT_EQ(fresh_run.rc, 0) << fresh_run.out;
  EXPECT_TRUE(contains(fresh_run.out,
                       "hp-train: no checkpoint under '" + dir + "' yet; starting at step 1"))
      << fresh_run.out;
  EXPECT_EQ(read_json(m)["steps"][0]["step"], 1);
  EXPECT_EQ(step_dirs(dir), std::vector<std::string>{"step_00000002"});
  // With a checkpoint there, --resume-if-exists resumes from it.
  auto again = run(kTiny + "--steps 3 --checkpoint-dir " + dir + " --resume-if-exists");
  ASSERT_EQ(again.rc, 0) << again.out;
  EXPECT_TRUE(contains(again.out, "hp-train: resumed from " + dir + "/step_00000002")) << again.out;
}

TEST(HpTrainReliability, ResumingAFinishedRunSaysSo) {
  const std::string dir = fresh("ckpt_finished");
  ASSERT_EQ(run(kTiny + "--steps 2 --checkpoint-every 1 --checkpoint-dir " + dir).rc, 0);
  auto r = run(kTiny + "--steps 2 --checkpoint-dir " + dir + " --resume");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "hp-train: the run in '" + dir +
                                  "' is finished: its last checkpoint is step 2 of --steps 2"))
      << r.out;
  EXPECT_FALSE(contains(r.out, "hp-train: done")) << r.out;
}

TEST(HpTrainReliability, ResumeRefusesAChangedSeqLenOrSeedAndWarnsOnLr) {
  const std::string dir = fresh("ckpt_changed");
  ASSERT_EQ(run(kTiny + "--steps 2 --checkpoint-dir " + dir + " --lr 0.01").rc, 0);
  const std::string step = dir + "/step_00000002";
  auto seq = run("--nproc 2 --cp 2 --seq-len 64 --steps 3 --checkpoint-dir " + dir + " --resume");
  EXPECT_NE(seq.rc, 0) << seq.out;
  EXPECT_TRUE(contains(seq.out, "hp-train --resume: checkpoint '" + step +
                                    "' was written with --seq-len 32, this run has --seq-len 64"))
      << seq.out;
  auto seed = run(kTiny + "--steps 3 --seed 7 --checkpoint-dir " + dir + " --resume");
  EXPECT_NE(seed.rc, 0) << seed.out;
  EXPECT_TRUE(contains(seed.out, "hp-train --resume: checkpoint '" + step +
                                     "' was written with --seed 0, this run has --seed 7"))
      << seed.out;
  auto lr = run(kTiny + "--steps 3 --lr 0.02 --checkpoint-dir " + dir + " --resume");
  EXPECT_EQ(lr.rc, 0) << lr.out;
  EXPECT_TRUE(contains(lr.out, "hp-train --resume: warning: checkpoint '" + step +
                                   "' was written with --lr 0.01, this run has --lr 0.02"))
      << lr.out;
  EXPECT_TRUE(contains(lr.out, "resumed from " + step)) << lr.out;
}

}  // namespace
