// hp-train's model families (--arch qwen3-moe | qwen3.5 | kimi-linear, --layer-pattern) end to
// end: every family under a small grid of layouts (CP, TP, EP, HSDP) validates against the
// single-process run (the loss of every step and every gradient after step 1, experts of all EP
// ranks included), each family learns the copy task, and each illegal combination is refused by
// text before any collective.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include "hp/model/hf.h"
#include "hp_train_util.h"
#include "rank_harness.h"

namespace {

using namespace hp::train_testing;

const std::string kModel = "--hidden 32 --heads 4 --kv-heads 2 --head-dim 8 --ffn 48 ";
const std::string kMoE = "--experts 4 --moe-ffn 24 ";

struct Layout {
  std::string name, args, arch, plan_text;
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << l.name;
}

class HpTrainFamilies : public ::testing::TestWithParam<Layout> {};

TEST_P(HpTrainFamilies, ValidatesAgainstTheSingleProcessRun) {
  const auto& c = GetParam();
  const std::string m = hp::testing::scratch_dir() + "/family_" + c.name + ".json";
  auto r = run(c.args + " " + kModel + "--seq-len 64 --steps 3 --validate --metrics-json " + m);
  ASSERT_EQ(r.rc, 0) << c.args << "\n" << r.out;
  auto j = metrics(m);
  losses(j, 3);
  expect_validated(r.out, j, 3, 1e-4);
  EXPECT_EQ(j["config"]["arch"], c.arch);
  EXPECT_NE(r.out.find(c.plan_text), std::string::npos) << c.plan_text << "\n" << r.out;
  if (j["config"]["experts"].get<int64_t>() > 0) {
    for (const auto& s : j["steps"]) {
      EXPECT_GT(s.at("moe_aux_loss").get<double>(), 0.5) << s;  // about 1 per layer balanced
      EXPECT_EQ(s.at("moe_dropped").get<int64_t>(), 0) << s;    // no capacity: nothing dropped
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, HpTrainFamilies,
    ::testing::Values(
        Layout{"moe_cp2_ep2", "--nproc 2 --cp 2 --arch qwen3-moe " + kMoE + "--ep 2", "qwen3-moe",
               "expert parallel: ep=2, 2 MoE layers, experts 0..1 of 4"},
        Layout{"moe_hsdp_ep4", "--nproc 4 --cp 2 --dp-shard 2 --arch qwen3-moe " + kMoE + "--ep 4",
               "qwen3-moe", "hsdp: R=1 x Sd=4 (dp_shard=2 x cp=2), comm_fusion=off ep=4"},
        Layout{
            "moe_tp2_ulysses_shared",
            "--nproc 4 --cp 2 --tp 2 --cp-algo ulysses --kv-head-policy repeat --arch qwen3-moe " +
                kMoE + "--ep 2 --shared-expert-ffn 16",
            "qwen3-moe", "algorithm=ulysses"},
        Layout{"moe_replicate_fusion_zloss",
               "--nproc 4 --cp 2 --dp-replicate 2 --comm-fusion on --arch qwen3-moe " + kMoE +
                   "--ep 2 --z-loss-coef 0.001",
               "qwen3-moe", "gradients summed over 2 ranks holding the same experts"},
        Layout{"qwen35_state_passing", "--nproc 2 --cp 2 --arch qwen3.5 --layers 4", "qwen3.5",
               "linear: mode=state_passing state_exchange=all_gather"},
        Layout{"qwen35_ulysses_moe_async",
               "--nproc 2 --cp 2 --arch qwen3.5 --layers 4 --cp-mode ulysses --cp-algo ulysses "
               "--schedule async " +
                   kMoE + "--ep 2",
               "qwen3.5",
               "linear: mode=ulysses hsdp: R=1 x Sd=2 (dp_shard=1 x cp=2), comm_fusion=off ep=2"},
        // Packed documents reach the linear layers too: their state and conv restart per document.
        Layout{"qwen35_packed_state_passing_p2p",
               "--nproc 2 --cp 2 --arch qwen3.5 --layers 4 --pack-documents --state-exchange p2p",
               "qwen3.5", "linear: mode=state_passing state_exchange=p2p"},
        Layout{"qwen35_packed_ulysses_async",
               "--nproc 2 --cp 2 --arch qwen3.5 --layers 4 --pack-documents --cp-mode ulysses "
               "--cp-algo ulysses --schedule async",
               "qwen3.5", "linear: mode=ulysses"},
        Layout{"qwen35_hsdp", "--nproc 4 --cp 2 --dp-shard 2 --arch qwen3.5 --layers 4", "qwen3.5",
               "hsdp: R=1 x Sd=4"},
        Layout{"kimi_mla_ulysses_ep2",
               "--nproc 2 --cp 2 --arch kimi-linear --layers 4 " + kMoE + "--ep 2 --mla-cp ulysses",
               "kimi-linear", "mla: strategy=ulysses"},
        // ... and the MLA layers: kimi-linear packed, async (its linear layers take no
        // head-tail balance; the MLA CP tests cover balanced documents).
        Layout{"kimi_packed_async",
               "--nproc 2 --cp 2 --arch kimi-linear --layers 4 --pack-documents --schedule async",
               "kimi-linear", "mla: strategy=latent_all_gather schedule=async"},
        Layout{"kimi_hsdp_async",
               "--nproc 4 --cp 2 --dp-shard 2 --arch kimi-linear --layers 4 " + kMoE +
                   "--ep 2 --schedule async",
               "kimi-linear", "mla: strategy=latent_all_gather schedule=async"},
        Layout{"hybrid_balanced_async",
               "--nproc 4 --cp 4 --cp-algo hybrid --ulysses-degree 2 --schedule async "
               "--load-balance",
               "qwen3",
               "strategy=hybrid schedule=async cp_size=4 ulysses_degree=2 colossal_degree=2 "
               "load_balance=data_order"},
        Layout{"gated_tp2_ring_balanced",
               "--nproc 4 --cp 2 --tp 2 --layer-pattern AG --cp-algo ring --load-balance", "qwen3",
               "algorithm=ring"},
        Layout{"ring_kept_blocks",
               "--nproc 2 --cp 2 --cp-algo ring --load-balance --ring-keep-blocks", "qwen3",
               "ring_keep_blocks=true"},
        Layout{"ring_queries_backward", "--nproc 2 --cp 2 --cp-algo ring --ring-backward queries",
               "qwen3", "ring_backward=queries"},
        Layout{"ulysses_row_parts_async",
               "--nproc 2 --cp 2 --cp-algo ulysses --schedule async --ulysses-row-parts 2", "qwen3",
               "ulysses_row_parts=2"},
        Layout{"usp_kept_blocks_async",
               "--nproc 4 --cp 4 --cp-algo usp --ulysses-degree 2 --schedule async "
               "--ring-keep-blocks",
               "qwen3", "ring_keep_blocks=true"}),
    [](const auto& info) { return info.param.name; });

// Each family learns the copy task (the softmax layers carry the copy; linear-heavy stacks learn
// it more slowly, so the bar is a clear fall, not convergence).
TEST(HpTrainFamilies, EachFamilyLearnsTheCopyTask) {
  struct Case {
    std::string args;
    double below;  // the final loss is below this fraction of the first
  };
  for (const auto& c :
       {Case{"--arch qwen3-moe --experts 4 --ep 2", 0.3}, Case{"--arch qwen3.5 --layers 4", 0.95},
        Case{"--arch kimi-linear --layers 4 --experts 4 --ep 2", 0.95}}) {
    // The embedded task's model (hidden 64): the copy is learnt within 60 steps.
    const std::string m = hp::testing::scratch_dir() + "/family_learns.json";
    auto r = run("--nproc 2 --cp 2 " + c.args + " --seq-len 64 --steps 60 --metrics-json " + m);
    ASSERT_EQ(r.rc, 0) << c.args << "\n" << r.out;
    auto l = losses(metrics(m), 60);
    EXPECT_LT(l.back(), c.below * l.front()) << c.args;
  }
}

// --mode validate (layouts checked at every module boundary) runs every family and gives the
// production run's losses bitwise.
TEST(HpTrainFamilies, ValidateModeEqualsProductionForEveryFamily) {
  for (const std::string& arch :
       {"--arch qwen3-moe " + kMoE + "--ep 2", std::string("--arch qwen3.5 --layers 4"),
        "--arch kimi-linear --layers 4 " + kMoE + "--ep 2"}) {
    const std::string base = "--nproc 2 --cp 2 " + arch + " " + kModel + "--seq-len 64 --steps 2 ";
    const std::string p = hp::testing::scratch_dir() + "/family_prod.json";
    const std::string v = hp::testing::scratch_dir() + "/family_valid.json";
    auto rp = run(base + "--metrics-json " + p);
    auto rv = run(base + "--mode validate --metrics-json " + v);
    ASSERT_EQ(rp.rc, 0) << rp.out;
    ASSERT_EQ(rv.rc, 0) << rv.out;
    EXPECT_NE(rv.out.find("(validate mode)"), std::string::npos) << rv.out;
    EXPECT_EQ(losses(metrics(p), 2), losses(metrics(v), 2)) << arch;
  }
}

// With --recompute the MoE layers' aux losses leave each recomputed layer as outputs of their
// own, so their gradients survive: the run equals the one without recompute, with and without
// HSDP (before, recompute silently dropped the aux loss's gradient).
TEST(HpTrainFamilies, RecomputeKeepsTheMoELossGradients) {
  for (const std::string& layout : {std::string("--nproc 1"), std::string("--nproc 2 --dp-shard 2"),
                                    std::string("--nproc 2 --cp 2 --ep 2")}) {
    const std::string base = layout + " --arch qwen3-moe " + kMoE + kModel +
                             "--aux-loss-coef 1 --seq-len 64 --steps 3 --metrics-json ";
    const std::string a = hp::testing::scratch_dir() + "/family_norecompute.json";
    const std::string b = hp::testing::scratch_dir() + "/family_recompute.json";
    auto ra = run(base + a);
    auto rb = run(base + b + " --recompute");
    ASSERT_EQ(ra.rc, 0) << ra.out;
    ASSERT_EQ(rb.rc, 0) << rb.out;
    const auto la = losses(metrics(a), 3), lb = losses(metrics(b), 3);
    for (size_t i = 0; i < la.size(); ++i)
      EXPECT_NEAR(la[i], lb[i], 1e-6) << layout << " step " << i + 1;
  }
}

// Sharded checkpoints of an EP layout (experts per rank, outside HSDP): a resumed run continues
// the exact trajectory, and resuming under another --ep is refused.
TEST(HpTrainFamilies, ExpertParallelCheckpointsResumeExactly) {
  const std::string dir = hp::testing::scratch_dir() + "/family_ep_ckpt";
  const std::string layout = "--nproc 4 --cp 2 --dp-shard 2 --arch qwen3-moe " + kMoE + kModel +
                             "--seq-len 64 --checkpoint-dir " + dir + " ";
  const std::string whole = hp::testing::scratch_dir() + "/family_ep_whole.json";
  const std::string resumed = hp::testing::scratch_dir() + "/family_ep_resumed.json";
  auto w = run("--nproc 4 --cp 2 --dp-shard 2 --arch qwen3-moe " + kMoE + kModel +
               "--seq-len 64 --ep 2 --steps 4 --metrics-json " + whole);
  ASSERT_EQ(w.rc, 0) << w.out;
  auto a = run(layout + "--ep 2 --steps 2");
  ASSERT_EQ(a.rc, 0) << a.out;
  auto b = run(layout + "--ep 2 --steps 4 --resume --metrics-json " + resumed);
  ASSERT_EQ(b.rc, 0) << b.out;
  const auto l_whole = losses(metrics(whole), 4);
  const auto l_resumed = losses(metrics(resumed), 2, 3);
  EXPECT_EQ(l_resumed[0], l_whole[2]);
  EXPECT_EQ(l_resumed[1], l_whole[3]);
  auto c = run(layout + "--ep 4 --steps 6 --resume");
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.out.find("another layout or model (--ep: checkpoint 2, this run 4;"),
            std::string::npos)
      << c.out;
  EXPECT_NE(c.out.find("--dp-replicate/--ep and model sizes"), std::string::npos) << c.out;
  // Routing settings change no tensor's shape but the model's function: refused by name, every
  // one that differs; the loss weights only warn (as --lr does).
  auto d = run(layout + "--ep 2 --steps 6 --resume --top-k 1 --capacity-factor 0.5");
  EXPECT_NE(d.rc, 0);
  // Top-1 without --init-from weighs by the probability (renormalised it would be 1).
  EXPECT_NE(d.out.find("other data, routing or model settings (--top-k: checkpoint 2, this run 1; "
                       "--capacity-factor: checkpoint 0, this run 0.5; --moe-renormalize "
                       "(config.json norm_topk_prob): checkpoint true, this run false)"),
            std::string::npos)
      << d.out;
  EXPECT_EQ(d.out.find("  step "), std::string::npos) << "no step may run: " << d.out;
  // The flag the message names sets it back: only --top-k and --capacity-factor still differ.
  auto d2 = run(layout + "--ep 2 --steps 6 --resume --top-k 1 --moe-renormalize on");
  EXPECT_NE(d2.rc, 0);
  EXPECT_NE(d2.out.find("other data, routing or model settings (--top-k: checkpoint 2, this run "
                        "1); resume"),
            std::string::npos)
      << d2.out;
  auto e = run(layout + "--ep 2 --steps 5 --resume --aux-loss-coef 0.5");
  EXPECT_EQ(e.rc, 0) << e.out;
  EXPECT_NE(e.out.find("warning: checkpoint '" + dir +
                       "/step_00000004' was written with other loss weights (--aux-loss-coef: "
                       "checkpoint 0.01, this run 0.5)"),
            std::string::npos)
      << e.out;
}

// The checkpoint records the partial RoPE: a resume under another factor is refused (the weights
// were trained with theirs); a new run from the weights (--init-weights) may change it.
TEST(HpTrainFamilies, ResumeKeepsThePartialRotaryFactor) {
  const std::string dir = hp::testing::scratch_dir() + "/family_rotary_ckpt";
  const std::string base = "--nproc 2 --cp 2 --arch qwen3.5 --layers 4 " + kModel + "--seq-len 64 ";
  auto a = run(base + "--steps 2 --checkpoint-dir " + dir);
  ASSERT_EQ(a.rc, 0) << a.out;
  auto b = run(base + "--steps 3 --checkpoint-dir " + dir + " --resume --partial-rotary-factor 1");
  EXPECT_NE(b.rc, 0);
  EXPECT_NE(b.out.find("was written with partial_rotary_factor 0.25, this run has 1; resume with "
                       "--partial-rotary-factor 0.25"),
            std::string::npos)
      << b.out;
  auto c = run(base + "--steps 1 --partial-rotary-factor 0.5 --init-weights " + dir);
  EXPECT_EQ(c.rc, 0) << c.out;
}

// A Hugging Face checkpoint (written by Python: bf16, sharded with an index) trains under any
// layout from its weights (each rank reads its slices; --validate's single-process run reads
// the whole), and export -> import -> export across layouts is bitwise, every value equal to
// the original (bf16 -> fp32 is exact).
TEST(HpTrainFamilies, HuggingFaceCheckpointsLoadIntoAnyLayoutAndExportBitwise) {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "Debian's python3-torch is not installed";
  }
  const std::string dir = hp::testing::scratch_dir();
  for (const auto& [type, extra] :
       std::vector<std::pair<std::string, std::string>>{{"qwen3_moe", ""}, {"qwen3", "tied"}}) {
    const std::string src = dir + "/hf_src_" + type;
    auto py = hp::testing::run_command("/usr/bin/python3 " + std::string(HP_HF_REFERENCE_SCRIPT) +
                                       " " + src + " " + type + " sharded bf16 " + extra);
    ASSERT_EQ(py.rc, 0) << py.out;
    const std::string layout = type == "qwen3" ? "--nproc 4 --cp 2 --tp 2 --cp-algo ring"
                                               : "--nproc 4 --cp 2 --dp-shard 2 --ep 2";
    const std::string m = dir + "/hf_train_" + type + ".json";
    auto r = run(layout + " --init-from " + src + " --seq-len 32 --steps 2 --validate " +
                 "--metrics-json " + m);
    ASSERT_EQ(r.rc, 0) << r.out;
    expect_validated(r.out, metrics(m), 2, 1e-4);
    EXPECT_NE(r.out.find("initialised from " + src), std::string::npos) << r.out;
    EXPECT_EQ(metrics(m)["config"]["arch"], type == "qwen3" ? "qwen3" : "qwen3-moe");
    const std::string a = dir + "/hf_a_" + type, b = dir + "/hf_b_" + type;
    auto ea = run(layout + " --init-from " + src + " --steps 0 --export-hf " + a);
    ASSERT_EQ(ea.rc, 0) << ea.out;
    auto eb = run("--init-from " + a + " --steps 0 --export-hf " + b);
    ASSERT_EQ(eb.rc, 0) << eb.out;
    auto same =
        hp::testing::run_command("cmp " + a + "/model.safetensors " + b + "/model.safetensors");
    EXPECT_EQ(same.rc, 0) << same.out;
    hp::model::HFDirectory original(src), exported(a);
    hp::model::SafetensorsFile file(a + "/model.safetensors");
    for (const auto& name : file.names()) {
      EXPECT_TRUE(at::equal(exported.view(name), original.view(name).to(at::kFloat))) << name;
    }
  }
  expect_refused("--init-from " + dir + "/hf_a_qwen3 --hidden 64",
                 {"--hidden and --init-from both set the model", "drop --hidden"});
  expect_refused("--arch qwen3.5 --layers 4 --export-hf " + dir + "/x",
                 {"supported for the qwen3 and qwen3-moe families"});
}

// A Hugging Face directory whose config.json does not describe its weights, or asks for what
// the model does not do, is refused by name before any step (it trained silently: the unread
// layers dropped, YaRN and gelu ignored).
TEST(HpTrainFamilies, HuggingFaceConfigsThatDoNotDescribeTheWeightsAreRefused) {
  const std::string src = hp::testing::scratch_dir() + "/hf_config_src";
  auto e = run("--layers 2 " + kModel + "--seq-len 32 --steps 1 --export-hf " + src);
  ASSERT_EQ(e.rc, 0) << e.out;
  auto edited = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const std::string dir = hp::testing::scratch_dir() + "/hf_config_" + name;
    std::filesystem::remove_all(dir);
    std::filesystem::copy(src, dir);
    std::ifstream in(dir + "/config.json");
    auto j = nlohmann::json::parse(in);
    in.close();
    edit(j);
    std::ofstream(dir + "/config.json") << j.dump(2);
    return dir;
  };
  // (Which tensors the model reads is known once it is built: refused before step 1.)
  auto fewer = run("--steps 1 --seq-len 32 --init-from " +
                   edited("fewer_layers", [](nlohmann::json& j) { j["num_hidden_layers"] = 1; }));
  EXPECT_EQ(fewer.rc, 1) << fewer.out;
  EXPECT_NE(fewer.out.find("tensor(s) this model does not read (model.layers.1."),
            std::string::npos)
      << fewer.out;
  EXPECT_NE(fewer.out.find("its config.json does not describe its weights"), std::string::npos)
      << fewer.out;
  EXPECT_EQ(fewer.out.find("  step "), std::string::npos) << "no step may run: " << fewer.out;
  expect_refused(
      "--steps 1 --init-from " + edited("yarn",
                                        [](nlohmann::json& j) {
                                          j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
                                        }),
      {"rope_scaling is not supported"});
  expect_refused("--steps 1 --init-from " +
                     edited("gelu", [](nlohmann::json& j) { j["hidden_act"] = "gelu"; }),
                 {"hidden_act='gelu' is not supported"});
  // A config smaller than its weights (4 fewer vocabulary rows) is refused under every layout:
  // sharded, each rank's slice of the larger tensor had the slice's shape and loaded silently.
  const auto smaller_vocab = edited("smaller_vocab", [](nlohmann::json& j) {
    j["vocab_size"] = j["vocab_size"].get<int64_t>() - 4;
  });
  for (const std::string layout : {"", "--nproc 2 --dp-shard 2 "}) {
    auto r = run(layout + "--steps 1 --seq-len 32 --init-from " + smaller_vocab);
    EXPECT_EQ(r.rc, 1) << layout << r.out;
    EXPECT_NE(r.out.find("(before sharding); the checkpoint does not match the model"),
              std::string::npos)
        << layout << r.out;
    EXPECT_EQ(r.out.find("  step "), std::string::npos) << "no step may run: " << r.out;
  }
  // Sizes that are not integers, a missing one, zero heads (a division by zero) and a scaled
  // RoPE in newer transformers' rope_parameters are refused by key.
  expect_refused("--steps 1 --init-from " +
                     edited("float_size", [](nlohmann::json& j) { j["hidden_size"] = 32.5; }),
                 {"config.json': hidden_size is 32.5; it must be an integer"});
  expect_refused("--steps 1 --init-from " +
                     edited("no_vocab", [](nlohmann::json& j) { j.erase("vocab_size"); }),
                 {"config.json' has no vocab_size"});
  expect_refused("--steps 1 --init-from " + edited("zero_heads",
                                                   [](nlohmann::json& j) {
                                                     j["num_attention_heads"] = 0;
                                                     j.erase("head_dim");
                                                   }),
                 {"num_attention_heads is 0; it must be positive"});
  expect_refused("--steps 1 --init-from " +
                     edited("rope_parameters",
                            [](nlohmann::json& j) {
                              j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
                            }),
                 {"rope_parameters.rope_type is not supported"});
  // A null rope_scaling, as Hugging Face writes it, is fine.
  auto ok = run("--steps 1 --seq-len 32 --init-from " +
                edited("null_scaling", [](nlohmann::json& j) { j["rope_scaling"] = nullptr; }));
  EXPECT_EQ(ok.rc, 0) << ok.out;
}

TEST(HpTrainFamilies, IllegalCombinationsAreRefusedByText) {
  expect_refused("--nproc 2 --cp 2 --arch qwen3-moe --experts 4 --ep 3",
                 {"ep=3 must divide dp_shard x cp = 1 x 2 = 2"});
  expect_refused("--nproc 4 --cp 4 --arch qwen3-moe --experts 6 --ep 4 --seq-len 64",
                 {"has 6 experts, not divisible by ep=4"});
  expect_refused("--nproc 2 --cp 2 --experts 4 --top-k 5",
                 {"RouterOptions.top_k=5 must be between 1 and experts=4"});
  expect_refused("--nproc 2 --cp 2 --ep 2", {"--ep, --top-k, --moe-ffn", "apply to MoE models"});
  expect_refused("--moe-renormalize off", {"--moe-renormalize apply to MoE models"});
  expect_refused("--experts 4 --moe-renormalize yes",
                 {"--moe-renormalize 'yes' is not valid; valid: on, off, auto"});
  expect_refused("--nproc 2 --cp 2 --arch qwen3.5 --layers 4 --load-balance",
                 {"drop --load-balance for a model with linear layers"});
  expect_refused("--nproc 2 --tp 2 --arch qwen3.5",
                 {"linear-attention layers have no tensor parallelism"});
  expect_refused("--nproc 2 --tp 2 --arch kimi-linear",
                 {"linear-attention layers have no tensor parallelism"});
  expect_refused("--arch qwen4", {"--arch 'qwen4' is not a model family; valid: qwen3, "
                                  "qwen3-moe, qwen3.5, kimi-linear"});
  expect_refused("--layer-pattern LXA", {"has 'x'; valid letters"});
  expect_refused("--arch qwen3.5 --mixer kda", {"chooses every layer's mixer; drop --mixer"});
  expect_refused("--arch qwen3.5 --layers 4 --partial-rotary-factor 0.3",
                 {"Qwen3Config.partial_rotary_factor=0.3 with head_dim=16 rotates 4.8 channels"});
  expect_refused("--nproc 2 --cp 2 --experts 4 --capacity-factor 1 --validate",
                 {"drops tokens per rank", "drop --capacity-factor or --validate"});
  // Values a family's defaults would otherwise overwrite, or a sign the expert width dropped.
  expect_refused("--arch qwen3-moe --experts 0",
                 {"--arch qwen3-moe is a mixture-of-experts family, but --experts 0 asks for a "
                  "dense MLP; drop --experts 0 (qwen3-moe defaults to 8 experts)"});
  expect_refused("--arch kimi-linear --experts 0 --layers 4", {"--arch kimi-linear is a mixture"});
  expect_refused("--experts 4 --moe-ffn -5", {"Qwen3Config.moe_ffn=-5 must be >= 0"});
  // An infinite loss weight made step 1 non-finite after the collectives had started.
  expect_refused("--experts 4 --z-loss-coef inf",
                 {"z_loss_coef=inf must be finite and >= 0 (--aux-loss-coef, --z-loss-coef)"});
  // A pattern longer than the layers would drop its later kinds (qwen3.5's G layer).
  expect_refused("--arch qwen3.5 --layers 2",
                 {"Qwen3Config.layers=2 is shorter than layer_pattern=LLLG (4 layers, from --arch "
                  "or --layer-pattern), so its last 2 would never be built; use --layers 4 or "
                  "more"});
  expect_refused("--layer-pattern LLLA --layers 3", {"Qwen3Config.layers=3 is shorter"});
}

// Without --layers a family's pattern sets the depth (the embedded task's 2 layers would build
// only qwen3.5's linear layers); MoE experts are not split by TP, so an ffn that TP does not
// divide is legal with experts.
TEST(HpTrainFamilies, DefaultsThatKeepTheFamilyWhole) {
  const std::string json = hp::testing::scratch_dir() + "/family_default_layers.json";
  auto r = run("--arch qwen3.5 " + kModel + "--seq-len 32 --steps 1 --metrics-json " + json);
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto j = metrics(json);
  EXPECT_EQ(j["config"]["layers"], 4) << j["config"];
  auto t =
      run("--nproc 2 --tp 2 --experts 4 --ffn 47 --moe-ffn 24 --hidden 32 --heads 4 "
          "--kv-heads 2 --head-dim 8 --seq-len 32 --steps 1");
  EXPECT_EQ(t.rc, 0) << t.out;
}

}  // namespace
