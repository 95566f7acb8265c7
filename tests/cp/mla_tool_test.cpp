// hp-cp-run --attention mla|dsa end to end: a torch.save file in (float64 or float32), the
// whole-sequence results out, compared with the float64 explicit references
// (harness/reference_mla.h); counted bytes equal the cp/mla.h formula; bad names and shapes
// refused before anything runs. hp-bench cp --attention mla|dsa: bytes against the formula.
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <nlohmann/json.hpp>

#include "hp/common/check.h"
#include "pickle_io.h"
#include "rank_harness.h"
#include "reference_mla.h"
#include "tool_json.h"

namespace {

using hp::testing::expect_close;
using hp::testing::last_json;

using hp::testing::load_dict;
using hp::testing::save_dict;

constexpr int64_t kB = 1, kS = 24, kH = 4, kNope = 8, kRope = 4, kDv = 6, kRank = 10;

c10::Dict<std::string, at::Tensor> mla_file() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(41);
  auto r = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, at::kDouble); };
  c10::Dict<std::string, at::Tensor> d;
  d.insert("q", r({kB, kS, kH, kNope + kRope}));
  d.insert("latent", r({kB, kS, kRank}));
  d.insert("k_rope", r({kB, kS, kRope}));
  d.insert("w_ukv", r({kH * (kNope + kDv), kRank}) * 0.3);
  d.insert("dout", r({kB, kS, kH, kDv}));
  return d;
}

TEST(HpCpRun, MLAMatchesTheExplicitScoreReference) {
  const std::string& dir = hp::testing::scratch_dir();
  const auto file = mla_file();
  auto leaf = [&](const char* n) { return file.at(n).clone().requires_grad_(true); };
  auto q = leaf("q"), latent = leaf("latent"), k_rope = leaf("k_rope"), w = leaf("w_ukv");
  auto ref_out = hp::testing::reference_mla(q, latent, k_rope, w, kDv);
  ref_out.backward(file.at("dout"));
  const std::map<std::string, at::Tensor> ref{{"out", ref_out.detach()},
                                              {"dq", q.grad()},
                                              {"dlatent", latent.grad()},
                                              {"dk_rope", k_rope.grad()},
                                              {"dw_ukv", w.grad()}};
  const std::string in = dir + "/mla_in.pt", out = dir + "/mla_out.pt";
  save_dict(in, file);
  for (const std::string args :
       {"--cp 2", "--cp 3 --cp-algo latent_all_gather --schedule async --load-balance",
        "--cp 4 --cp-algo ulysses --schedule async", "--cp 2 --cp-algo all_gather --load-balance",
        "--cp 1"}) {
    const std::string cmd = hp::common::str_cat(HP_CP_RUN_BINARY, " --input ", in, " --output ",
                                                out, " --attention mla ", args);
    auto r = hp::testing::run_command(cmd);
    ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    auto res = load_dict(out);
    for (const auto& [name, want] : ref) {
      ASSERT_TRUE(res.contains(name)) << args << ": no " << name;
      expect_close(res.at(name).toTensor(), want, args + " " + name, 1e-9, 1e-9);
    }
    auto j = last_json(r.out);
    EXPECT_EQ(j["attention"], "mla");
    EXPECT_EQ(j["d_v"], kDv);
    const auto theory = j["comm_bytes_theory"].get<int64_t>();
    for (const auto& b : j["comm_bytes_per_rank"])
      EXPECT_EQ(b.get<int64_t>(), theory) << args << "\n" << r.out;
    EXPECT_EQ(theory > 0, j["cp"].get<int>() > 1) << r.out;
    if (j["cp_algo"] == "latent_all_gather" && j["cp"].get<int>() > 1) {
      // (R + dr) per token instead of H (dq + dv)
      EXPECT_EQ(j["expanded_kv_gather_bytes_theory"].get<int64_t>() * (kRank + kRope),
                theory * kH * (kNope + kRope + kDv))
          << r.out;
    }
  }
}

// --cu-seqlens: packed documents (a document spanning the rank boundary, one of one token);
// every result equals each document run alone through the reference.
TEST(HpCpRun, MLATakesPackedDocuments) {
  const std::string& dir = hp::testing::scratch_dir();
  const auto file = mla_file();
  auto leaf = [&](const char* n) { return file.at(n).clone().requires_grad_(true); };
  auto q = leaf("q"), latent = leaf("latent"), k_rope = leaf("k_rope"), w = leaf("w_ukv");
  const std::vector<int64_t> cu{0, 5, 6, 17, 24};
  std::vector<at::Tensor> docs;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    auto cut = [&](const at::Tensor& t) { return t.narrow(1, cu[i], cu[i + 1] - cu[i]); };
    docs.push_back(hp::testing::reference_mla(cut(q), cut(latent), cut(k_rope), w, kDv));
  }
  auto ref_out = at::cat(docs, 1);
  ref_out.backward(file.at("dout"));
  const std::map<std::string, at::Tensor> ref{{"out", ref_out.detach()},
                                              {"dq", q.grad()},
                                              {"dlatent", latent.grad()},
                                              {"dk_rope", k_rope.grad()},
                                              {"dw_ukv", w.grad()}};
  const std::string in = dir + "/mla_docs_in.pt", out = dir + "/mla_docs_out.pt";
  save_dict(in, file);
  for (const std::string args : {"--cp 2 --schedule async --load-balance",
                                 "--cp 4 --cp-algo ulysses", "--cp 3 --cp-algo all_gather"}) {
    const std::string cmd =
        hp::common::str_cat(HP_CP_RUN_BINARY, " --input ", in, " --output ", out,
                            " --attention mla --cu-seqlens 0,5,6,17,24 ", args);
    auto r = hp::testing::run_command(cmd);
    ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    auto res = load_dict(out);
    for (const auto& [name, want] : ref)
      expect_close(res.at(name).toTensor(), want, args + " " + name, 1e-9, 1e-9);
    auto j = last_json(r.out);
    EXPECT_EQ(j["documents"], 4) << r.out;
    for (const auto& b : j["comm_bytes_per_rank"])  // documents add no bytes
      EXPECT_EQ(b, j["comm_bytes_theory"]) << args << "\n" << r.out;
  }
}

TEST(HpCpRun, MLARefusesBadNamesAndShapesBeforeAnyRun) {
  namespace fs = std::filesystem;
  const std::string dir = hp::testing::scratch_dir() + "/mla_bad";
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto file = mla_file();
  save_dict(dir + "/mla.pt", file);
  const std::string out = dir + "/out.pt";
  const std::string base = std::string(HP_CP_RUN_BINARY) + " --output " + out + " --input ";
  auto expect_refused = [&](const std::string& args, const std::string& text) {
    auto r = hp::testing::run_command(base + args);
    EXPECT_EQ(r.rc, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(text), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find("comm_bytes"), std::string::npos) << "nothing ran\n" << r.out;
    EXPECT_FALSE(fs::exists(out)) << args;
  };
  const std::string mla = dir + "/mla.pt --attention mla";
  expect_refused(mla + " --cp 2 --cp-algo ring",
                 "MLA CP strategy='ring' is not valid; valid: latent_all_gather, ulysses");
  expect_refused(mla + " --cp 3 --cp-algo ulysses",
                 "MLA heads must be divisible by TP x CP: heads=4, cp_size=3");
  expect_refused(mla + " --cp 5", "the sequence length S=24 is not divisible by 5 (--cp)");
  expect_refused(mla + " --cp 5 --load-balance",
                 "the sequence length S=24 is not divisible by 10 (2 * --cp, load balance)");
  expect_refused(mla + " --cp 2 --layout bshd", "--layout does not apply to --attention mla");
  expect_refused(mla + " --cp 2 --cp-mode ulysses", "--cp-mode does not apply to --attention mla");
  expect_refused(dir + "/mla.pt --attention gqa",
                 "--attention 'gqa' is not valid; valid: softmax, mla, dsa");
  expect_refused(mla + " --topk 4", "--topk applies to --attention dsa");
  expect_refused(mla + " --cu-seqlens 0,30", "cu_seqlens ends at 30 beyond the sequence length 24");
  expect_refused(dir + "/mla.pt --attention dsa --cu-seqlens 0,12,24",
                 "--cu-seqlens does not apply to --attention dsa");
  expect_refused(dir + "/mla.pt --attention dsa", "'" + dir + "/mla.pt' has no entry 'q_index'");
  expect_refused(dir + "/mla.pt --attention dsa --cp-algo ulysses",
                 "--cp-algo 'ulysses' is not a DSA strategy");
  file.insert_or_assign("k_rope", at::zeros({kB, kS + 1, kRope}, at::kDouble));
  save_dict(dir + "/rope.pt", file);
  expect_refused(dir + "/rope.pt --attention mla", "k_rope [1, 25, 4] must be [B=1, S=24, d_rope]");
  file = mla_file();
  file.insert_or_assign("w_ukv", at::zeros({kH * (kNope + kDv) + 1, kRank}, at::kDouble));
  save_dict(dir + "/w.pt", file);
  expect_refused(dir + "/w.pt --attention mla",
                 "w_ukv [57, 10] must be [H * (d_nope + d_v), kv_rank]");
  file = mla_file();
  file.insert_or_assign("kv", at::zeros({1}));
  save_dict(dir + "/typo.pt", file);
  expect_refused(dir + "/typo.pt --attention mla",
                 "has an entry 'kv' this run does not know; valid: q, latent, k_rope and w_ukv "
                 "(optional: dout)");
}

// MLA's file and DSA's indexer inputs: 3 index heads of dim 5.
c10::Dict<std::string, at::Tensor> dsa_file() {
  auto file = mla_file();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(43);
  file.insert("q_index", at::randn({kB, kS, 3, 5}, gen, at::kDouble));
  file.insert("w_index", at::randn({kB, kS, 3}, gen, at::kDouble).abs());
  file.insert("k_index", at::randn({kB, kS, 5}, gen, at::kDouble));
  return file;
}

// hp-cp-run --attention dsa: against the explicit reference (selection as sets, the summed
// loss, every gradient), sparse and dense, sync and async, balanced, and the clamped top-k.
TEST(HpCpRun, DSAMatchesTheExplicitReference) {
  const std::string& dir = hp::testing::scratch_dir();
  auto file = dsa_file();
  const std::string in = dir + "/dsa_in.pt", out = dir + "/dsa_out.pt";
  save_dict(in, file);
  struct Case {
    std::string args, loss;
    int64_t topk;
  };
  for (const Case& c : {Case{"--cp 2 --topk 5", "sparse", 5},
                        Case{"--cp 3 --topk 5 --schedule async --load-balance", "sparse", 5},
                        Case{"--cp 2 --topk 4 --index-loss dense", "dense", 4},
                        Case{"--cp 1 --topk 100", "sparse", 100}}) {
    auto leaf = [&](const char* n) { return file.at(n).clone().requires_grad_(true); };
    auto q = leaf("q"), latent = leaf("latent"), k_rope = leaf("k_rope"), w = leaf("w_ukv");
    auto qi = leaf("q_index"), wi = leaf("w_index"), ki = leaf("k_index");
    auto ref = hp::testing::reference_dsa(q, latent, k_rope, w, kDv, qi, wi, ki, c.topk, c.loss);
    ((ref.out * file.at("dout")).sum() + ref.loss).backward();
    const std::string cmd = hp::common::str_cat(HP_CP_RUN_BINARY, " --input ", in, " --output ",
                                                out, " --attention dsa ", c.args);
    auto r = hp::testing::run_command(cmd);
    ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    auto res = load_dict(out);
    expect_close(res.at("out").toTensor(), ref.out.detach(), c.args + " out", 1e-9, 1e-9);
    expect_close(res.at("index_loss").toTensor(), ref.loss.detach(), c.args + " loss", 1e-9, 1e-9);
    const std::map<std::string, at::Tensor> grads{
        {"dq", q.grad()},       {"dlatent", latent.grad()}, {"dk_rope", k_rope.grad()},
        {"dw_ukv", w.grad()},   {"dq_index", qi.grad()},    {"dw_index", wi.grad()},
        {"dk_index", ki.grad()}};
    for (const auto& [name, want] : grads)
      expect_close(res.at(name).toTensor(), want, c.args + " " + name, 1e-8, 1e-9);
    auto idx = res.at("topk_indices").toTensor();
    EXPECT_EQ(idx.size(2), std::min<int64_t>(c.topk, kS)) << c.args;
    auto mask = at::zeros({kB, kS, kS + 1}, at::kBool).scatter_(2, idx + 1, true).narrow(2, 1, kS);
    EXPECT_TRUE(at::equal(mask, ref.selected)) << c.args << ": the selection";
    auto j = last_json(r.out);
    EXPECT_EQ(j["attention"], "dsa");
    for (const auto& b : j["comm_bytes_per_rank"])
      EXPECT_EQ(b, j["comm_bytes_theory"]) << r.out;
    if (c.topk > kS) {
      EXPECT_NE(r.out.find("--topk 100 exceeds the sequence length 24; clamped to 24"),
                std::string::npos)
          << r.out;
    }
  }
}

// float32 files: hp-cp-run reads them and writes float32 results, equal to the
// float64 reference within float32's precision (MLA and DSA, sync and async).
TEST(HpCpRun, MLAAndDSATakeFloat32Files) {
  const std::string& dir = hp::testing::scratch_dir();
  auto file = dsa_file();
  c10::Dict<std::string, at::Tensor> f32;
  for (const auto& e : file)
    f32.insert(e.key(), e.value().to(at::kFloat));
  // MLA refuses the indexer's entries: its own file holds only MLA's.
  c10::Dict<std::string, at::Tensor> mla_only;
  for (const char* n : {"q", "latent", "k_rope", "w_ukv", "dout"})
    mla_only.insert(n, f32.at(n));
  const std::string dsa_in = dir + "/dsa_f32_in.pt", mla_in = dir + "/mla_f32_in.pt";
  const std::string out = dir + "/mla_f32_out.pt";
  save_dict(dsa_in, f32);
  save_dict(mla_in, mla_only);
  // The reference from the float32 values, in float64.
  auto leaf = [&](const char* n) { return f32.at(n).to(at::kDouble).requires_grad_(true); };
  auto q = leaf("q"), latent = leaf("latent"), k_rope = leaf("k_rope"), w = leaf("w_ukv");
  auto qi = leaf("q_index"), wi = leaf("w_index"), ki = leaf("k_index");
  const auto dout = f32.at("dout").to(at::kDouble);
  auto mla = hp::testing::reference_mla(q, latent, k_rope, w, kDv);
  auto mla_grads = torch::autograd::grad({mla}, {q, latent, k_rope, w}, {dout});
  auto dsa = hp::testing::reference_dsa(q, latent, k_rope, w, kDv, qi, wi, ki, 5, "sparse");
  auto dsa_grads = torch::autograd::grad({(dsa.out * dout).sum() + dsa.loss},
                                         {q, latent, k_rope, w, qi, wi, ki});
  const std::vector<std::string> names{"dq",       "dlatent",  "dk_rope", "dw_ukv",
                                       "dq_index", "dw_index", "dk_index"};
  for (const std::string args : {"--attention mla --cp 2 --schedule async --load-balance",
                                 "--attention mla --cp 2 --cp-algo ulysses",
                                 "--attention dsa --cp 2 --topk 5 --schedule async"}) {
    const bool is_dsa = args.find("dsa") != std::string::npos;
    const std::string cmd = hp::common::str_cat(
        HP_CP_RUN_BINARY, " --input ", is_dsa ? dsa_in : mla_in, " --output ", out, " ", args);
    auto r = hp::testing::run_command(cmd);
    ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    auto res = load_dict(out);
    auto got = [&](const std::string& name) {
      auto t = res.at(name).toTensor();
      EXPECT_EQ(t.scalar_type(), at::kFloat) << args << " " << name;
      return t.to(at::kDouble);
    };
    expect_close(got("out"), (is_dsa ? dsa.out : mla).detach(), args + " out", 1e-4, 1e-4);
    const auto& grads = is_dsa ? dsa_grads : mla_grads;
    for (size_t i = 0; i < grads.size(); ++i)
      expect_close(got(names[i]), grads[i], args + " " + names[i], 1e-3, 1e-4);
    if (is_dsa) {
      expect_close(got("index_loss"), dsa.loss.detach(), args + " loss", 1e-4, 1e-4);
      auto idx = res.at("topk_indices").toTensor();
      auto mask =
          at::zeros({kB, kS, kS + 1}, at::kBool).scatter_(2, idx + 1, true).narrow(2, 1, kS);
      EXPECT_TRUE(at::equal(mask, dsa.selected)) << args << ": the selection";
    }
  }
}

// hp-bench cp --attention mla: both gathers in one run by default, counted bytes equal the
// formula, the latent form sends (R + dr) / (H (dq + dv)) of the expanded one.
TEST(MLABench, RunsLatentAndExpandedGathersWithCountedBytesEqualToTheFormula) {
  const std::string cmd = std::string(HP_BENCH_BINARY) +
                          " cp --attention mla --seq 96 --heads 4 --d-nope 8 --d-rope 4 --d-v 6 "
                          "--kv-rank 10 --cp 2 --iters 1 --json";
  auto r = hp::testing::run_command(cmd);
  ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
  auto j = last_json(r.out)["results"];
  ASSERT_EQ(j.size(), 2u) << r.out;
  EXPECT_EQ(j[0]["algorithm"], "latent_all_gather");
  EXPECT_EQ(j[1]["algorithm"], "all_gather");
  for (const auto& res : j) {
    EXPECT_EQ(res["comm_bytes_per_rank"], res["comm_bytes_theory"]) << r.out;
    EXPECT_GT(res["step_time_s"].get<double>(), 0) << r.out;
  }
  EXPECT_EQ(j[0]["comm_bytes_per_rank"].get<int64_t>() * kH * (kNope + kRope + kDv),
            j[1]["comm_bytes_per_rank"].get<int64_t>() * (kRank + kRope))
      << r.out;
  auto one = hp::testing::run_command(cmd + " --cp-algo ulysses --schedule async");
  ASSERT_EQ(one.rc, 0) << one.out;
  auto u = last_json(one.out)["results"];
  ASSERT_EQ(u.size(), 1u) << one.out;
  EXPECT_EQ(u[0]["algorithm"], "ulysses");
  EXPECT_EQ(u[0]["comm_bytes_per_rank"], u[0]["comm_bytes_theory"]) << one.out;
  auto bad = hp::testing::run_command(cmd + " --kv-heads 2");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("--kv-heads does not apply to --attention mla"), std::string::npos)
      << bad.out;
}

// hp-bench cp --attention dsa: DSA (indexer, top-k, sparse attention, indexer loss) beside dense
// latent_all_gather MLA of the same shape, both under CP, sync and balanced; each rank's counted
// bytes equal its formula, and DSA sends the index keys besides the latent.
TEST(MLABench, DSARunsBesideDenseMLAWithCountedBytesEqualToTheFormula) {
  const std::string cmd = std::string(HP_BENCH_BINARY) +
                          " cp --attention dsa --seq 96 --heads 4 --d-nope 8 --d-rope 4 --d-v 6 "
                          "--kv-rank 10 --index-heads 2 --index-dim 6 --topk 8 --cp 2 --iters 1 "
                          "--load-balance --json";
  auto r = hp::testing::run_command(cmd);
  ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
  auto j = last_json(r.out)["results"];
  ASSERT_EQ(j.size(), 2u) << r.out;
  EXPECT_EQ(j[0]["attention"], "dsa");
  EXPECT_EQ(j[0]["algorithm"], "all_gather");
  EXPECT_EQ(j[1]["attention"], "mla");
  EXPECT_EQ(j[1]["algorithm"], "latent_all_gather");
  for (const auto& res : j) {
    EXPECT_EQ(res["comm_bytes_per_rank"], res["comm_bytes_theory"]) << r.out;
    EXPECT_GT(res["step_time_s"].get<double>(), 0) << r.out;
    EXPECT_EQ(res["load_balance"], true) << r.out;
  }
  // Forward: (P-1) S/P (d_I + R + dr) elements of 4 bytes for DSA, (R + dr) for the latent.
  EXPECT_EQ(j[0]["comm_bytes_per_rank"].get<int64_t>() * (kRank + kRope),
            j[1]["comm_bytes_per_rank"].get<int64_t>() * (6 + kRank + kRope))
      << r.out;
  EXPECT_EQ(j[0]["topk"], 8) << r.out;
  // A top-k beyond the sequence: clamped with a note, and the JSON records what ran.
  auto clamped = hp::testing::run_command(
      std::string(HP_BENCH_BINARY) +
      " cp --attention dsa --seq 32 --heads 2 --d-nope 8 --d-rope 4 --d-v 6 --kv-rank 10 "
      "--index-heads 2 --index-dim 6 --topk 100 --cp 2 --iters 1 --json");
  ASSERT_EQ(clamped.rc, 0) << clamped.out;
  EXPECT_NE(clamped.out.find("--topk 100 exceeds --seq 32; clamped to 32"), std::string::npos)
      << clamped.out;
  EXPECT_EQ(last_json(clamped.out)["results"][0]["topk"], 32) << clamped.out;
}

}  // namespace
