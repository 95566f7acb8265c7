// What hp-train writes and where, checked before step 1: a --checkpoint-dir that already holds
// another run's steps, an --export-hf directory it cannot write, and the export of a finished
// run that --resume restores; and the options a restart or a step would only reject later.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "hp_train_util.h"
#include "rank_harness.h"

namespace {

namespace fs = std::filesystem;
using hp::train_testing::contains;
using hp::train_testing::fresh;
using hp::train_testing::kTiny;
using hp::train_testing::run;

// A new run in a directory holding a run's checkpoints would replace them step by step, and a
// restart (which adds --resume) or a later --resume could continue the older run: refused before
// step 1, with the way out; --resume and --resume-if-exists continue it as before.
TEST(HpTrainOutputs, ANewRunInAUsedCheckpointDirIsRefused) {
  const std::string dir = fresh("outputs_used_ckpt");
  ASSERT_EQ(run(kTiny + "--steps 2 --checkpoint-dir " + dir).rc, 0);
  auto again = run(kTiny + "--steps 3 --lr 0.01 --checkpoint-dir " + dir);
  EXPECT_EQ(again.rc, 1) << again.out;
  EXPECT_TRUE(contains(again.out, "--checkpoint-dir '" + dir +
                                      "' already holds the checkpoints of a run (the newest is '" +
                                      dir + "/step_00000002'); add --resume"))
      << again.out;
  EXPECT_FALSE(contains(again.out, "  step ")) << again.out;
  auto resumed = run(kTiny + "--steps 3 --checkpoint-dir " + dir + " --resume");
  EXPECT_EQ(resumed.rc, 0) << resumed.out;
  EXPECT_TRUE(contains(resumed.out, "resumed from " + dir + "/step_00000002")) << resumed.out;
  // What a crash leaves (a .tmp step without a manifest) is no run: a new one starts.
  const std::string crashed = fresh("outputs_crashed_ckpt");
  fs::create_directories(crashed + "/step_00000001.tmp");
  EXPECT_EQ(run(kTiny + "--steps 1 --checkpoint-dir " + crashed).rc, 0);
}

// --export-hf is tried for writing before step 1 (it failed after the last step, on rank 0 only,
// while the other ranks waited in the export's gathers).
TEST(HpTrainOutputs, AnUnwritableExportDirIsRefusedBeforeStepOne) {
  const std::string dir = fresh("outputs_export_file");
  fs::create_directories(dir);
  { std::ofstream(dir + "/a_file") << "x"; }
  auto r = run(kTiny + "--steps 2 --export-hf " + dir + "/a_file");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "cannot write --export-hf '" + dir + "/a_file'")) << r.out;
  EXPECT_FALSE(contains(r.out, "  step ")) << r.out;
}

// A finished run resumed with --export-hf exports the restored weights (it said "finished" and
// skipped the export, so a restart after a failed export lost it); the export equals the one the
// run itself wrote.
TEST(HpTrainOutputs, AFinishedRunResumedWithExportHfExportsIt) {
  const std::string dir = fresh("outputs_finished_export");
  const std::string ckpt = dir + "/ckpt", first = dir + "/hf_first", later = dir + "/hf_later";
  auto trained = run(kTiny + "--steps 2 --checkpoint-dir " + ckpt + " --export-hf " + first);
  ASSERT_EQ(trained.rc, 0) << trained.out;
  auto r = run(kTiny + "--steps 2 --checkpoint-dir " + ckpt + " --resume --export-hf " + later);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "is finished: its last checkpoint is step 2 of --steps 2")) << r.out;
  EXPECT_TRUE(contains(r.out, "hp-train: exported the model to " + later)) << r.out;
  auto same = hp::testing::run_command("cmp " + first + "/model.safetensors " + later +
                                       "/model.safetensors");
  EXPECT_EQ(same.rc, 0) << same.out;
}

// Options that failed only later: --validate under --max-restarts (the restart adds --resume,
// which --validate refuses, so the job ended naming a --resume the user never gave), a negative
// or non-finite --index-loss-coef (the indexer maximised its loss), negative MLA ranks and
// linear value heads (silently the defaults), an explicit --partial-rotary-factor -1.
TEST(HpTrainOutputs, OptionsThatFailedLaterAreRefusedAtOnce) {
  const std::string dir = fresh("outputs_validate_restarts");
  hp::train_testing::expect_refused(
      kTiny + "--steps 2 --validate --max-restarts 1 --checkpoint-every 1 --checkpoint-dir " + dir,
      {"--max-restarts 1 resumes a failed run from its last checkpoint, but --validate compares a "
       "whole run from step 1; drop one of them"});
  hp::train_testing::expect_refused("--steps 1 --attention dsa --index-loss-coef=-1",
                                    {"--index-loss-coef -1 must be a finite number >= 0"});
  hp::train_testing::expect_refused("--steps 1 --attention mla --kv-rank=-4",
                                    {"Qwen3Config.kv_rank=-4 must be >= 0"});
  hp::train_testing::expect_refused("--steps 1 --arch qwen3.5 --layers 4 --value-heads=-2",
                                    {"Qwen3Config.value_heads=-2 must be >= 0"});
  // -1 was the "not given" value: an explicit -1 meant the family's factor.
  hp::train_testing::expect_refused("--steps 1 --partial-rotary-factor=-1",
                                    {"Qwen3Config.partial_rotary_factor=-1 with head_dim="});
}

// The manifest records what else the model computes with (the DSA top-k; RoPE's theta, the norm's
// epsilon and MoE's renormalisation, which --init-from reads from config.json): a resume that
// changes it is refused; a changed indexer loss weight is a warning, like --lr.
TEST(HpTrainOutputs, ResumeComparesTheModelsOtherSettings) {
  const std::string dir = fresh("outputs_dsa_resume");
  const std::string dsa = kTiny + "--attention dsa --checkpoint-dir " + dir + " ";
  ASSERT_EQ(run(dsa + "--steps 1").rc, 0);
  auto topk = run(dsa + "--steps 2 --topk 8 --resume");
  EXPECT_EQ(topk.rc, 1) << topk.out;
  EXPECT_TRUE(contains(topk.out, "(--topk: checkpoint 2048, this run 8)")) << topk.out;
  EXPECT_FALSE(contains(topk.out, "  step ")) << topk.out;
  auto coef = run(dsa + "--steps 2 --index-loss-coef 0.5 --resume");
  EXPECT_EQ(coef.rc, 0) << coef.out;
  EXPECT_TRUE(contains(coef.out,
                       "other loss weights (--index-loss-coef: checkpoint 1, this run "
                       "0.5)"))
      << coef.out;
}

// The checkpoint records --data by its content: the same file under another path resumes (the
// path was compared, so ./a.txt against /x/a.txt was refused), a file rewritten in place is
// refused (it resumed on other data).
TEST(HpTrainOutputs, ResumeComparesTheDataByItsContent) {
  const std::string dir = fresh("outputs_data_resume");
  fs::create_directories(dir);
  const std::string text = dir + "/corpus.txt";
  const auto write = [&](const std::string& line) {
    std::ofstream f(text, std::ios::trunc);
    for (int i = 0; i < 100; ++i)
      f << line << i << "\n";
  };
  write("the quick brown fox ");
  const std::string base = kTiny + "--vocab 256 --checkpoint-dir " + dir + "/ckpt ";
  ASSERT_EQ(run(base + "--steps 1 --data " + text).rc, 0);
  auto other_path = run(base + "--steps 2 --resume --data " + dir + "/./corpus.txt");
  EXPECT_EQ(other_path.rc, 0) << other_path.out;
  EXPECT_TRUE(contains(other_path.out, "resumed from " + dir + "/ckpt/step_00000001"))
      << other_path.out;
  write("jumps over the lazy dog ");
  auto rewritten = run(base + "--steps 3 --resume --data " + text);
  EXPECT_EQ(rewritten.rc, 1) << rewritten.out;
  EXPECT_TRUE(contains(rewritten.out,
                       "other data, routing or model settings (--data's tokens: "
                       "checkpoint "))
      << rewritten.out;
  EXPECT_FALSE(contains(rewritten.out, "  step ")) << rewritten.out;
}

}  // namespace
