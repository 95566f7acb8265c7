// hp-train under faults and bad input (issue 13): damaged checkpoints fail naming the file and
// the rank; a non-finite loss stops the run (or skips its step) and keeps the last good
// checkpoint; output paths, options and memory are checked before step 1; checkpoint and resume
// edge cases; every file error names its file. Tiny runs: each command takes a second or two.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize/input-archive.h>
#include <nlohmann/json.hpp>

#include "hp_train_util.h"
#include "rank_harness.h"

namespace {
namespace fs = std::filesystem;
using hp::train_testing::contains;
using hp::train_testing::fresh;
using hp::train_testing::kTiny;

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
    // This rank's shard: HSDP shards the 16 rows over the two CP ranks.
    EXPECT_EQ(rec["tensors"][0]["shape"], nlohmann::json::array({8, 64}));
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
    EXPECT_TRUE(contains(r.out, "this run expects [8, 64] (float32)")) << r.out;
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

// A checkpoint of a --cp layout written before HSDP sharded the parameters there (its plan names
// no hsdp) holds whole parameters: refused by name, not read as shards.
TEST(HpTrainReliability, ACheckpointOfWholeParametersIsRefused) {
  const std::string dir = fresh("ckpt_whole");
  auto w = run(kTiny + "--steps 1 --checkpoint-dir " + dir);
  ASSERT_EQ(w.rc, 0) << w.out;
  const std::string manifest = dir + "/step_00000001/manifest.json";
  auto m = read_json(manifest);
  auto plan = m["plan"].get<std::string>();
  const auto at = plan.find(" hsdp: ");
  ASSERT_NE(at, std::string::npos) << plan;
  plan.erase(at, plan.find(" modules=") - at);
  m["plan"] = plan;
  std::ofstream(manifest) << m.dump(2);
  auto r = run(kTiny + "--steps 2 --checkpoint-dir " + dir + " --resume");
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "holds every parameter whole on each rank")) << r.out;
  EXPECT_FALSE(contains(r.out, "  step 2/2")) << r.out;
}

// A damaged newest step names the older one beside it and how to resume from it; done so, the
// run resumes from that step.
TEST(HpTrainReliability, ADamagedStepNamesTheStepBeforeIt) {
  const std::string dir = fresh("ckpt_older");
  auto w = run(kTiny + "--steps 2 --checkpoint-every 1 --checkpoint-dir " + dir);
  ASSERT_EQ(w.rc, 0) << w.out;
  const std::string two = dir + "/step_00000002";
  fs::resize_file(two + "/rank1.model.pt", fs::file_size(two + "/rank1.model.pt") / 2);
  auto r = run(kTiny + "--steps 3 --checkpoint-dir " + dir + " --resume");
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "truncated or replaced; the step before, '" + dir +
                                  "/step_00000001', may be whole: move '" + two + "' out of '" +
                                  dir + "' to resume from it"))
      << r.out;
  fs::rename(two, fresh("ckpt_older_damaged"));
  auto again = run(kTiny + "--steps 3 --checkpoint-dir " + dir + " --resume");
  EXPECT_EQ(again.rc, 0) << again.out;
  EXPECT_TRUE(contains(again.out, "hp-train: resumed from " + dir + "/step_00000001")) << again.out;
}

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

// A rank's own refusal (here the non-finite loss of --nan-policy error) is not worth a restart
// under --max-restarts: the same data would give the same loss again.
TEST(HpTrainReliability, MaxRestartsDoesNotRerunARefusal) {
  const std::string dir = fresh("nan_no_restart");
  auto r = run(kTiny + "--steps 4 --max-restarts 2 --checkpoint-every 1 --checkpoint-dir " + dir,
               "HP_TEST_NAN_AT_STEP=2 HP_TEST_NAN_RANK=1");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "non-finite loss (nan) at step 2 (first seen on rank 1)")) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "not restarting (2 restarts left): the rank refused the run's own "
                       "options or inputs, which a restart repeats"))
      << r.out;
  EXPECT_FALSE(contains(r.out, "restarting all ranks")) << r.out;
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

// --validate beside a skipped step: the reference skips the same update, the skipped step's
// loss is not compared, and the gradients are those of the first step that updated. Under HSDP
// (step 1 skipped) and CP with head-tail balance (step 3).
TEST(HpTrainReliability, ValidateSkipsTheStepsTheRunSkipped) {
  struct Case {
    std::string layout, nan_step, grad_step;
  };
  for (const Case& c : {Case{"--nproc 2 --dp-shard 2 --seq-len 32 ", "1", "2"},
                        Case{kTiny + "--cp-algo ring --load-balance ", "3", "1"}}) {
    const std::string m = fresh("nan_skip_validate_" + c.nan_step + ".json");
    auto r = run(c.layout + "--steps 4 --nan-policy skip-step --validate --metrics-json " + m,
                 "HP_TEST_NAN_AT_STEP=" + c.nan_step + " HP_TEST_NAN_RANK=1");
    ASSERT_EQ(r.rc, 0) << r.out;
    auto j = read_json(m);
    EXPECT_TRUE(j["steps"][std::stoi(c.nan_step) - 1]["skipped"].get<bool>()) << r.out;
    hp::train_testing::expect_validated(r.out, j, 3, 1e-4);
    EXPECT_TRUE(contains(r.out, "difference after step " + c.grad_step + " = ")) << r.out;
    EXPECT_TRUE(contains(r.out, "(1 skipped step not compared)")) << r.out;
  }
}

// ---- 4. output paths checked before step 1 ----

TEST(HpTrainReliability, UnwritableOutputPathsFailBeforeStepOne) {
  const std::string dir = fresh("outputs");
  fs::create_directories(dir + "/a_dir");
  std::ofstream(dir + "/a_file") << "x";
  struct Case {
    std::string flag, path, text;
  };
  for (const Case& c : {Case{"--metrics-json", dir + "/no/such/dir/m.json", "' does not exist"},
                        Case{"--metrics-json", dir + "/a_dir", "is a directory"},
                        Case{"--trace", dir + "/no_dir/t.json", "' does not exist"},
                        Case{"--trace", dir + "/a_dir", "is a directory"},
                        Case{"--checkpoint-dir", dir + "/a_file/ckpt", "cannot create"},
                        Case{"--checkpoint-dir", dir + "/a_file", "is not a directory"}}) {
    auto r = run(kTiny + "--steps 2 " + c.flag + " " + c.path);
    EXPECT_NE(r.rc, 0) << c.flag << " " << c.path << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, "hp-train: cannot write " + c.flag + " '" + c.path + "'"))
        << c.flag << " " << c.path << "\n"
        << r.out;
    EXPECT_TRUE(contains(r.out, c.text)) << c.text << "\n" << r.out;
    EXPECT_FALSE(contains(r.out, "  step 1/")) << "no step may run\n" << r.out;
  }
  EXPECT_EQ(step_dirs(dir), (std::vector<std::string>{"a_dir", "a_file"})) << "nothing left behind";
}

// ---- 5. checkpoint interval, resume edge cases ----

TEST(HpTrainReliability, CheckpointDirAloneSavesAtTheEnd) {
  const std::string dir = fresh("ckpt_end");
  auto r = run(kTiny + "--steps 3 --checkpoint-dir " + dir);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(step_dirs(dir), std::vector<std::string>{"step_00000003"});
  auto neg = run(kTiny + "--steps 3 --checkpoint-every -2 --checkpoint-dir " + dir);
  EXPECT_NE(neg.rc, 0);
  EXPECT_TRUE(contains(neg.out, "--checkpoint-every -2 must be >= 0")) << neg.out;
  EXPECT_FALSE(contains(neg.out, "  step 1/")) << neg.out;
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
  // What else the batches depend on: refused, every changed setting named with both values
  // (the resumed run above wrote step 3, with --lr 0.02 and the default --batch 4).
  auto data = run(kTiny +
                  "--steps 4 --lr 0.02 --batch 2 --grad-accum 3 --pack-documents "
                  "--checkpoint-dir " +
                  dir + " --resume");
  EXPECT_NE(data.rc, 0) << data.out;
  EXPECT_TRUE(
      contains(data.out, "hp-train --resume: checkpoint '" + dir + "/step_00000003" +
                             "' was written with other data, routing or model settings (--batch: "
                             "checkpoint 4, this run 2; --pack-documents: checkpoint false, "
                             "this run true; --grad-accum: checkpoint 1, this run 3)"))
      << data.out;
  EXPECT_FALSE(contains(data.out, "  step ")) << "no step may run: " << data.out;
}

// --validate compares a whole run: with a checkpoint to resume from it is refused before any
// step (it trained, wrote checkpoints and only then refused).
TEST(HpTrainReliability, ValidateWithAResumeIsRefusedBeforeAnyStep) {
  const std::string dir = fresh("ckpt_validate_resume");
  ASSERT_EQ(run(kTiny + "--steps 2 --checkpoint-dir " + dir).rc, 0);
  auto r = run(kTiny + "--steps 4 --checkpoint-every 1 --checkpoint-dir " + dir +
               " --resume-if-exists --validate");
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "--validate compares a whole run from step 1, but this run resumes "
                       "at step 3"))
      << r.out;
  EXPECT_FALSE(contains(r.out, "  step ")) << "no step may run: " << r.out;
  EXPECT_EQ(step_dirs(dir), std::vector<std::string>{"step_00000002"});
  auto resume = run(kTiny + "--steps 4 --checkpoint-dir " + dir + " --resume --validate");
  EXPECT_NE(resume.rc, 0) << resume.out;
  EXPECT_TRUE(contains(resume.out,
                       "--validate compares a whole run from step 1; drop it or "
                       "--resume"))
      << resume.out;
}

// What the metrics say a run did: tokens per second over the whole job's tokens of a step
// (every data-parallel rank's micro-batches), and the settings that change the run.
TEST(HpTrainReliability, MetricsCountTheJobsTokensAndRecordTheSettings) {
  const std::string m = fresh("metrics_tokens.json");
  auto r =
      run("--nproc 2 --dp-replicate 2 --seq-len 32 --batch 2 --grad-accum 3 --steps 2 "
          "--lr 0.02 --mode validate --metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto j = read_json(m);
  const double tokens = 2.0 * 3 * 2 * 32;  // batch x grad_accum x replicas x seq_len
  EXPECT_NEAR(j["tokens_per_s"].get<double>() * j["median_step_time_s"].get<double>(), tokens,
              1e-6 * tokens)
      << j;
  EXPECT_EQ(j["config"]["lr"], 0.02);
  EXPECT_EQ(j["config"]["mode"], "validate");
  // What the batches need is refused before any rank starts (it failed in every rank after
  // the plan and HSDP setup, and --max-restarts restarted it).
  const std::string bin = fresh("tokens.bin");
  {
    std::ofstream f(bin, std::ios::binary);
    for (uint16_t i = 0; i < 200; ++i) {
      const uint16_t id = i % 16;
      f.write(reinterpret_cast<const char*>(&id), sizeof(id));
    }
  }
  for (const auto& [args, text] : std::vector<std::pair<std::string, std::string>>{
           {"--seq-len 33", "--seq-len 33 must be even for the copy task"},
           {"--seq-len 8 --pack-documents", "--pack-documents with the copy task needs"},
           {"--data " + bin + " --data-dtype uint8", "--data-dtype 'uint8' is not valid"}}) {
    auto b = run("--nproc 2 --dp-shard 2 --steps 1 " + args);
    EXPECT_NE(b.rc, 0) << b.out;
    EXPECT_TRUE(contains(b.out, text)) << b.out;
    EXPECT_FALSE(contains(b.out, "hp-train: plan mesh")) << b.out;
  }
  for (const std::string bad : {"0", "0.5"}) {
    auto z = run("--steps 1 --memory-limit " + bad);
    EXPECT_NE(z.rc, 0) << z.out;
    EXPECT_TRUE(contains(z.out, "--memory-limit '" + bad + "' is less than one byte")) << z.out;
  }
}

// Rank `rank`'s model tensors of checkpoint step `step`, by name (read as --resume reads them).
std::vector<std::pair<std::string, at::Tensor>> saved_model(const std::string& step, int rank) {
  const auto manifest = read_json(step + "/manifest.json");
  torch::serialize::InputArchive archive;
  archive.load_from(step + "/rank" + std::to_string(rank) + ".model.pt");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& t : manifest["ranks"][rank]["tensors"]) {
    at::Tensor v;
    archive.read(t["name"].get<std::string>(), v);
    out.emplace_back(t["name"].get<std::string>(), v);
  }
  return out;
}

// The largest elementwise difference between two ranks' saved models (the same names in order).
double max_difference(const std::vector<std::pair<std::string, at::Tensor>>& a,
                      const std::vector<std::pair<std::string, at::Tensor>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    worst = std::max(worst, (a[i].second - b[i].second).abs().max().item<double>());
  }
  return worst;
}

// --init-weights starts a run at another --seq-len and --seed from a checkpoint's weights with a
// fresh optimizer: with a vanishing learning rate its first saved step holds the same weights
// (a fresh run's does not), and its steps count from 1. A checkpoint of another layout, or a
// path without one, is refused before step 1.
TEST(HpTrainReliability, InitWeightsStartsALongerRunFromACheckpointsWeights) {
  const std::string src = fresh("ckpt_init_src"), dst = fresh("ckpt_init_dst"),
                    cold = fresh("ckpt_init_cold");
  ASSERT_EQ(run(kTiny + "--steps 3 --checkpoint-dir " + src).rc, 0);
  const std::string from = src + "/step_00000003";
  const std::string longer = "--nproc 2 --cp 2 --seq-len 64 --seed 5 --lr 1e-12 --steps 1 ";
  auto r = run(longer + "--init-weights " + src + " --checkpoint-dir " + dst);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "hp-train: weights from " + from)) << r.out;
  ASSERT_EQ(step_dirs(dst), std::vector<std::string>{"step_00000001"});
  ASSERT_EQ(run(longer + "--checkpoint-dir " + cold).rc, 0);
  for (int rank = 0; rank < 2; ++rank) {
    const auto trained = saved_model(from, rank);
    EXPECT_LT(max_difference(saved_model(dst + "/step_00000001", rank), trained), 1e-6);
    EXPECT_GT(max_difference(saved_model(cold + "/step_00000001", rank), trained), 1e-3);
  }
  // A step directory works as well as the root above it.
  auto step = run(longer + "--init-weights " + from);
  EXPECT_EQ(step.rc, 0) << step.out;
  EXPECT_TRUE(contains(step.out, "hp-train: weights from " + from)) << step.out;

  auto layout = run("--nproc 2 --tp 2 --seq-len 64 --steps 1 --init-weights " + src);
  EXPECT_NE(layout.rc, 0);
  EXPECT_TRUE(contains(layout.out, "hp-train --init-weights: checkpoint '" + from +
                                       "' was written by another layout or model"))
      << layout.out;
  auto none = run(longer + "--init-weights " + cold + "/nothing");
  EXPECT_NE(none.rc, 0);
  EXPECT_TRUE(contains(
      none.out, "hp-train --init-weights: '" + cold + "/nothing' is neither a checkpoint step"))
      << none.out;
  for (const auto* out : {&layout.out, &none.out})
    EXPECT_FALSE(contains(*out, "  step 1/")) << *out;
  auto both = run(longer + "--init-weights " + src + " --init-from " + src);
  EXPECT_NE(both.rc, 0);
  EXPECT_TRUE(contains(both.out, "hp-train: --init-weights and --init-from both set the model"))
      << both.out;
  auto validate = run(longer + "--init-weights " + src + " --validate");
  EXPECT_NE(validate.rc, 0);
  EXPECT_TRUE(contains(validate.out, "holds only as this layout's shards; drop --validate"))
      << validate.out;
}

// ---- 10. options and sizes checked up front ----

TEST(HpTrainReliability, BadNumbersAreRefusedReadably) {
  for (const std::string lr : {"-1", "0", "nan", "inf"}) {
    auto r = run(kTiny + "--steps 2 --lr " + lr);
    EXPECT_NE(r.rc, 0) << lr << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, "--lr " + lr + " must be a finite number > 0")) << r.out;
  }
  auto steps = run(kTiny + "--steps 0");
  EXPECT_NE(steps.rc, 0) << steps.out;
  EXPECT_TRUE(contains(steps.out, "--steps 0 must be >= 1")) << steps.out;
  EXPECT_FALSE(contains(steps.out, "not in range")) << steps.out;
  auto hidden = run(kTiny + "--steps 2 --hidden 0");
  EXPECT_NE(hidden.rc, 0) << hidden.out;
  EXPECT_TRUE(contains(hidden.out, "--hidden 0 must be >= 1")) << hidden.out;
}

TEST(HpTrainReliability, ALayoutThatCannotFitIsRefusedBeforeAllocating) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run("--hidden 1000000 --steps 2");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_LT(s, 10.0) << r.out;
  EXPECT_TRUE(contains(r.out, "hp-train: not enough memory: this layout needs about")) << r.out;
  EXPECT_TRUE(contains(r.out, "parameters")) << r.out;
  EXPECT_TRUE(contains(r.out, "--hidden")) << "names the option to change\n" << r.out;
  EXPECT_FALSE(contains(r.out, "  step 1/")) << r.out;
  // The limit can be given (tests, shared machines): the same normal run is refused under a
  // tiny limit and runs under the default.
  auto small = run(kTiny + "--steps 1 --memory-limit 1M");
  EXPECT_NE(small.rc, 0) << small.out;
  EXPECT_TRUE(contains(small.out, "hp-train: not enough memory")) << small.out;
  EXPECT_TRUE(contains(small.out, "--memory-limit 1M")) << small.out;
  auto normal = run(kTiny + "--steps 1");
  EXPECT_EQ(normal.rc, 0) << normal.out;
}

// The estimate against the measured peak RSS of a small run whose model and activations are a
// fair part of the process (LibTorch alone is ~100-200 MiB): within a factor of 2.
TEST(HpTrainReliability, MemoryEstimateIsWithinAFactorOfTwoOfThePeak) {
  const std::string m = fresh("mem.json");
  auto r =
      run("--nproc 2 --cp 2 --hidden 512 --ffn 2048 --heads 8 --kv-heads 4 --head-dim 64 "
          "--layers 2 --vocab 256 --seq-len 512 --batch 2 --steps 2 --metrics-json " +
          m);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = read_json(m);
  const double est = j.at("memory_estimate_bytes_per_rank").get<double>();
  const double peak = j.at("peak_rss_bytes_max_rank").get<double>();
  EXPECT_GT(est, peak / 2) << r.out;
  EXPECT_LT(est, peak * 2) << r.out;
  EXPECT_TRUE(contains(r.out, "memory: about")) << r.out;
}

// ---- 11. file errors name the file ----

TEST(HpTrainReliability, FileErrorsNameTheFile) {
  const std::string dir = fresh("files");
  fs::create_directories(dir + "/data_dir");
  auto data = run(kTiny + "--steps 1 --data " + dir + "/data_dir");
  EXPECT_NE(data.rc, 0) << data.out;
  EXPECT_TRUE(contains(data.out, "--data '" + dir + "/data_dir' is a directory")) << data.out;
  EXPECT_FALSE(contains(data.out, "basic_filebuf")) << data.out;

  const std::string ckpt = dir + "/ckpt";
  ASSERT_EQ(run(kTiny + "--steps 1 --checkpoint-dir " + ckpt).rc, 0);
  const std::string manifest = ckpt + "/step_00000001/manifest.json";
  std::ofstream(manifest) << "{\"step\": 1, \"world_size\": ";
  auto broken = run(kTiny + "--steps 2 --checkpoint-dir " + ckpt + " --resume");
  EXPECT_NE(broken.rc, 0) << broken.out;
  EXPECT_TRUE(
      contains(broken.out, "hp-train --resume: cannot read the manifest '" + manifest + "'"))
      << broken.out;

  std::ofstream(dir + "/cfg.json") << "{\"steps\": ";
  auto cfg = run(kTiny + "--config " + dir + "/cfg.json");
  EXPECT_NE(cfg.rc, 0) << cfg.out;
  EXPECT_TRUE(contains(cfg.out, "hp-train: cannot parse --config '" + dir + "/cfg.json'"))
      << cfg.out;
}

}  // namespace
