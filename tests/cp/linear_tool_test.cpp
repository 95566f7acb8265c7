// The linear-attention mixer tools end to end: hp-cp-run --mixer (a torch.save file in, the
// whole-sequence results out, compared with the single-process kernel; counted bytes equal the
// formula; bad names and shapes refused before anything runs) and hp-bench linear (its JSON
// fields; counted bytes equal the formula).
#include <filesystem>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <nlohmann/json.hpp>

#include "hp/attention/delta_rule.h"
#include "hp/common/check.h"
#include "pickle_io.h"
#include "rank_harness.h"
#include "tool_json.h"

namespace {

using hp::attention::GateKind;
using hp::testing::expect_close;
using hp::testing::last_json;

using hp::testing::load_dict;
using hp::testing::save_dict;

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

constexpr int64_t kB = 1, kT = 24, kH = 4, kHV = 8, kK = 4, kV = 3;

// The file's tensors for `mixer` (float64), the initial state and both output gradients.
c10::Dict<std::string, at::Tensor> mixer_file(const std::string& mixer) {
  auto normed = [](const at::Tensor& t) { return t / t.norm(2, -1, true); };
  c10::Dict<std::string, at::Tensor> d;
  d.insert("q", normed(rnd(1, {kB, kT, kH, kK})));
  d.insert("k", normed(rnd(2, {kB, kT, kH, kK})));
  d.insert("v", rnd(3, {kB, kT, kHV, kV}));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  std::vector<int64_t> gshape{kB, kT, kHV};
  if (mixer == "kda") gshape.push_back(kK);
  d.insert("g", at::rand(gshape, gen, at::kDouble) * -2.0);
  d.insert("beta", at::sigmoid(rnd(5, {kB, kT, kHV})));
  d.insert("initial_state", rnd(6, {kB, kHV, kK, kV}) * 0.5);
  d.insert("dout", rnd(7, {kB, kT, kHV, kV}));
  d.insert("dfinal_state", rnd(8, {kB, kHV, kK, kV}));
  return d;
}

// The single-process chunked kernel on the file: out, final_state and the six gradients.
// resets: packed documents (undefined: none).
std::map<std::string, at::Tensor> reference(const c10::Dict<std::string, at::Tensor>& d,
                                            const std::string& mixer,
                                            const at::Tensor& resets = {}) {
  hp::attention::MixerInputs in;
  in.resets = resets;
  auto leaf = [&](const char* n) { return d.at(n).clone().requires_grad_(true); };
  in.q = leaf("q");
  in.k = leaf("k");
  in.v = leaf("v");
  in.g = leaf("g");
  in.beta = leaf("beta");
  in.initial_state = leaf("initial_state");
  hp::attention::MixerOptions o;
  o.output_final_state = true;
  auto r = hp::attention::delta_rule_chunked(
      in, o, mixer == "kda" ? GateKind::kPerChannel : GateKind::kPerHead);
  torch::autograd::backward({r.out, r.final_state}, {d.at("dout"), d.at("dfinal_state")});
  return {{"out", r.out.detach()},   {"final_state", r.final_state.detach()},
          {"dq", in.q.grad()},       {"dk", in.k.grad()},
          {"dv", in.v.grad()},       {"dg", in.g.grad()},
          {"dbeta", in.beta.grad()}, {"dinitial_state", in.initial_state.grad()}};
}

// The last line of `out` that is a JSON object.
TEST(HpCpRun, MixerMatchesTheSingleProcessKernel) {
  const std::string& dir = hp::testing::scratch_dir();
  struct Case {
    std::string mixer, mode, exchange, ranks;
  };
  for (const Case& c :
       {Case{"gdn", "state_passing", "all_gather", "--nproc 2"},
        Case{"kda", "state_passing", "p2p", "--cp 3"}, Case{"kda", "ulysses", "", "--nproc 2"},
        Case{"gdn", "ulysses", "", "--cp 4"},
        Case{"kda", "", "", "--cp 1"}}) {  // one rank: no CP flag (refused: it would do nothing)
    const auto file = mixer_file(c.mixer);
    const auto ref = reference(file, c.mixer);
    const std::string in = dir + "/mixer_in.pt", out = dir + "/mixer_out.pt";
    save_dict(in, file);
    std::string cmd = hp::common::str_cat(HP_CP_RUN_BINARY, " --input ", in, " --output ", out, " ",
                                          c.ranks, " --mixer ", c.mixer, " --chunk-size 4");
    if (!c.mode.empty()) cmd += " --cp-mode " + c.mode;
    if (!c.exchange.empty()) cmd += " --state-exchange " + c.exchange;
    auto r = hp::testing::run_command(cmd);
    ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    auto res = load_dict(out);
    const std::string what = c.mixer + " " + c.mode + "/" + c.exchange + " " + c.ranks;
    for (const auto& [name, want] : ref) {
      ASSERT_TRUE(res.contains(name)) << what << ": no " << name;
      expect_close(res.at(name).toTensor(), want, hp::common::str_cat(what, " ", name), 1e-9, 1e-9);
    }
    auto j = last_json(r.out);
    EXPECT_EQ(j["mixer"], c.mixer);
    EXPECT_EQ(j["cp_mode"], c.mode.empty() ? "state_passing" : c.mode);  // the default
    EXPECT_EQ(j["backward"], true);
    const auto ranks = j["cp"].get<size_t>();
    ASSERT_EQ(j["comm_bytes_per_rank"].size(), ranks) << r.out;
    EXPECT_EQ(j["comm_bytes_per_rank"], j["comm_bytes_theory_per_rank"]) << r.out;
    EXPECT_EQ(j["comm_bytes_theory"].get<int64_t>() > 0, ranks > 1) << r.out;
  }
}

TEST(HpCpRun, MixerTakesPackedDocuments) {
  // Documents [0, 5) [5, 6) [6, 17) [17, 24): across the rank boundaries of P = 2, 3 and 4.
  auto resets = at::zeros({kB, kT}, at::kBool);
  for (int64_t t : {5, 6, 17})
    resets[0][t] = true;
  const std::string& dir = hp::testing::scratch_dir();
  for (const std::string mode : {"ulysses", "state_passing"}) {
    for (int p : {2, 4}) {
      const auto file = mixer_file("kda");
      const auto ref = reference(file, "kda", resets);
      const std::string in = dir + "/mixer_docs_in.pt", out = dir + "/mixer_docs_out.pt";
      save_dict(in, file);
      const std::string cmd = hp::common::str_cat(HP_CP_RUN_BINARY, " --input ", in, " --output ",
                                                  out, " --cp ", p, " --mixer kda --cp-mode ", mode,
                                                  " --chunk-size 4", " --cu-seqlens 0,5,6,17,24");
      auto r = hp::testing::run_command(cmd);
      ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
      auto res = load_dict(out);
      for (const auto& [name, want] : ref) {
        expect_close(res.at(name).toTensor(), want,
                     hp::common::str_cat(mode, " P=", p, " packed ", name), 1e-9, 1e-9);
      }
      auto j = last_json(r.out);
      EXPECT_EQ(j["documents"], 4);
      EXPECT_EQ(j["comm_bytes_per_rank"], j["comm_bytes_theory_per_rank"]) << r.out;
    }
  }
  // The documents change the result: the same file without them differs after token 5.
  auto plain = reference(mixer_file("kda"), "kda");
  auto packed = reference(mixer_file("kda"), "kda", resets);
  EXPECT_GT((plain.at("out") - packed.at("out")).narrow(1, 5, kT - 5).abs().max().item<double>(),
            1e-3);
}

TEST(HpCpRun, MixerRefusesBadNamesAndShapesBeforeAnyRun) {
  namespace fs = std::filesystem;
  const std::string dir = hp::testing::scratch_dir() + "/mixer_bad";
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto file = mixer_file("gdn");
  save_dict(dir + "/gdn.pt", file);
  const std::string out = dir + "/out.pt";
  const std::string base = std::string(HP_CP_RUN_BINARY) + " --output " + out + " --input ";
  auto expect_refused = [&](const std::string& args, const std::string& text) {
    auto r = hp::testing::run_command(base + args);
    EXPECT_EQ(r.rc, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(text), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find("comm_bytes"), std::string::npos) << "nothing ran\n" << r.out;
    EXPECT_FALSE(fs::exists(out)) << args;
  };
  const std::string gdn = dir + "/gdn.pt --cp 2";
  expect_refused(gdn + " --mixer rwkv", "--mixer 'rwkv' is not valid; valid: gdn, kda");
  expect_refused(gdn + " --mixer kda", "g has shape [1,24,8]; expected [1,24,8,4]");
  expect_refused(gdn + " --mixer gdn --cp-mode ring",
                 "mode='ring' is not valid; valid: ulysses, state_passing");
  expect_refused(gdn + " --mixer gdn --state-exchange tree",
                 "state_exchange='tree' is not valid; valid: all_gather, p2p");
  expect_refused(dir + "/gdn.pt --cp 8 --mixer gdn --cp-mode ulysses",
                 "mode=ulysses needs q/k heads (4) and value heads (8) divisible by cp_size=8");
  expect_refused(dir + "/gdn.pt --cp 5 --mixer gdn",
                 "the sequence length T=24 (q.size(1)) is not divisible by --cp 5");
  expect_refused(gdn + " --mixer gdn --causal", "--causal applies to attention, not to --mixer");
  expect_refused(gdn + " --mixer gdn --cp-mode ulysses --state-exchange p2p",
                 "state_exchange='p2p' chooses how mode=state_passing folds its states; "
                 "mode=ulysses exchanges none");
  expect_refused(gdn + " --mixer gdn --ring-backward blocks",
                 "--ring-backward applies to attention, not to --mixer");
  expect_refused(gdn + " --cp-mode ulysses", "--cp-mode applies to a linear-attention mixer only");
  expect_refused(gdn + " --mixer gdn --cu-seqlens 0,5,30", "cu_seqlens");
  file.insert_or_assign("dfinal", at::zeros({1}));
  save_dict(dir + "/typo.pt", file);
  expect_refused(dir + "/typo.pt --cp 2 --mixer gdn",
                 "has an entry 'dfinal' this run does not know; valid: q, k, v, g, beta");
  file = mixer_file("gdn");
  file.insert_or_assign("dout", at::zeros({1, 24, 8, 4}, at::kDouble));
  save_dict(dir + "/dout.pt", file);
  expect_refused(dir + "/dout.pt --cp 2 --mixer gdn",
                 "dout has shape [1,24,8,4]; it must be shaped like v [1,24,8,3]");
}

TEST(LinearBench, JsonFieldsAndCountedBytesEqualTheFormula) {
  struct Case {
    std::string mixer, cp;
  };
  for (const Case& c : {Case{"kda", "--cp 2 --cp-mode state_passing --state-exchange p2p"},
                        Case{"gdn", "--cp 2 --cp-mode ulysses"},
                        Case{"gdn", "--cp 3 --cp-mode state_passing --state-exchange all_gather"},
                        Case{"kda", "--cp 1"}}) {
    const std::string cmd = std::string(HP_BENCH_BINARY) + " linear --mixer " + c.mixer +
                            " --seq 96 --heads 6 --head-dim 8 --value-dim 4 --chunk-size 16 "
                            "--iters 1 --json " +
                            c.cp;
    auto r = hp::testing::run_command(cmd);
    ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    for (const char* field :
         {"mixer", "kernel", "cp", "seq", "heads", "value_heads", "head_dim", "value_dim", "fwd_s",
          "fwd_bwd_s", "flops_fwd", "flops_counted", "fwd_gflops", "fwd_bwd_gflops",
          "matmul_gflops", "comm_bytes_per_rank", "comm_bytes_theory", "peak_rss_bytes",
          "peak_rss_per_rank"}) {
      EXPECT_TRUE(j.contains(field)) << cmd << ": no " << field << "\n" << r.out;
    }
    EXPECT_EQ(j["mixer"], c.mixer);
    EXPECT_GT(j["fwd_s"].get<double>(), 0) << r.out;
    EXPECT_GT(j["fwd_bwd_gflops"].get<double>(), 0) << r.out;
    EXPECT_GT(j["matmul_gflops"].get<double>(), 0) << r.out;
    EXPECT_GT(j["peak_rss_bytes"].get<int64_t>(), 0) << r.out;
    const auto theory = j["comm_bytes_theory"].get<int64_t>();
    const auto ranks = j["cp"].get<int64_t>();
    EXPECT_EQ(theory > 0, ranks > 1) << r.out;
    ASSERT_EQ(j["comm_bytes_per_rank"].size(), static_cast<size_t>(ranks)) << r.out;
    for (const auto& b : j["comm_bytes_per_rank"]) {
      EXPECT_LE(std::abs(b.get<int64_t>() - theory), theory / 100) << cmd << "\n" << r.out;
    }
  }
  auto bad = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " linear --mixer gdn --seq 64 --heads 3 --cp 2 "
                                      "--cp-mode ulysses");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("mode=ulysses needs q/k heads (3) and value heads (3) divisible by "
                         "cp_size=2"),
            std::string::npos)
      << bad.out;
}

}  // namespace
