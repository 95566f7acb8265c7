// hp-cp-run end to end: a torch.save file in, full-sequence results out, compared with the
// single-process reference; the byte report; refusal of flags this build does not implement.
// With Debian's python3-torch present, the same round trip is also checked from PyTorch itself
// (torch.save input, torch.load output, reference computed by PyTorch).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hp/attention/attention.h"
#include "pickle_io.h"
#include "rank_harness.h"
#include "reference_attention.h"

namespace {

hp::testing::CommandResult run(const std::string& cmd) {
  return hp::testing::run_command(cmd);
}

using hp::testing::load_dict;
using hp::testing::save_dict;

at::Tensor seeded(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat);
}

// The causal math primitive on the whole tensors: out and the gradients of q, k, v for dout.
struct Reference {
  at::Tensor out, dq, dk, dv;
};
Reference causal_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& dout) {
  hp::attention::AttentionOptions o;
  o.causal = true;
  auto q1 = q.clone().requires_grad_(true), k1 = k.clone().requires_grad_(true),
       v1 = v.clone().requires_grad_(true);
  auto out = hp::attention::AttentionRegistry::builtin().get("math").forward(q1, k1, v1, o).out;
  out.backward(dout);
  return {out.detach(), q1.grad(), k1.grad(), v1.grad()};
}

struct Case {
  std::string algo;
  int cp;
  int degree;
  std::string adapter;
  bool bshd;
  std::string extra = "";
};

TEST(HpCpRun, MatchesTheSingleProcessReference) {
  const std::string dir = ::testing::TempDir();
  // B=1, Nq=8, Nkv=4, S=32, D=16 (BNSD); BSHD files hold the transposed tensors.
  auto q = seeded(1, {1, 8, 48, 16}), k = seeded(2, {1, 4, 48, 16}), v = seeded(3, {1, 4, 48, 16}),
       dout = seeded(4, {1, 8, 48, 16});
  const auto ref = causal_reference(q, k, v, dout);
  for (const Case& c :
       {Case{"all_gather", 2, 0, "sdpa_qkv", false}, Case{"all_gather", 4, 0, "sdpa_hf", true},
        Case{"ulysses", 4, 0, "flex_qkv", true}, Case{"ulysses", 2, 0, "flex_hf", false},
        Case{"hybrid", 4, 2, "sdpa_qkv", false},
        Case{"all_gather", 4, 0, "sdpa_qkv", false, " --load-balance"},
        Case{"all_gather", 3, 0, "sdpa_hf", true, " --load-balance --load-balance-form data_order"},
        Case{"hybrid", 4, 2, "sdpa_hf", true, " --load-balance"},
        Case{"ring", 4, 0, "sdpa_qkv", true}, Case{"usp", 4, 2, "sdpa_hf", true},
        Case{"usp", 4, 2, "sdpa_qkv", false, " --load-balance"},
        Case{"ring", 3, 0, "sdpa_hf", false, " --load-balance --load-balance-form data_order"},
        Case{"ring", 4, 0, "sdpa_qkv", false, " --load-balance --ring-keep-blocks"},
        Case{"ring", 3, 0, "sdpa_hf", true, " --ring-backward queries"},
        Case{"usp", 4, 2, "sdpa_qkv", false, " --load-balance --ring-backward blocks"},
        Case{"ulysses", 2, 0, "sdpa_qkv", true, " --schedule async --ulysses-head-groups 2"},
        Case{"ulysses", 4, 0, "sdpa_hf", false, " --schedule async --ulysses-row-parts 3"}}) {
    auto lay = [&](const at::Tensor& t) { return c.bshd ? t.transpose(1, 2).contiguous() : t; };
    c10::Dict<std::string, at::Tensor> in;
    in.insert("q", lay(q));
    in.insert("k", lay(k));
    in.insert("v", lay(v));
    in.insert("dout", lay(dout));
    const std::string ip = dir + "/cp_in.pt", op = dir + "/cp_out.pt";
    save_dict(ip, in);
    std::string cmd = std::string(HP_CP_RUN_BINARY) + " --input " + ip + " --output " + op +
                      " --cp " + std::to_string(c.cp) + " --cp-algo " + c.algo + " --causal" +
                      " --adapter " + c.adapter + " --layout " + (c.bshd ? "bshd" : "bnsd");
    if (c.degree) cmd += " --ulysses-degree " + std::to_string(c.degree);
    cmd += c.extra;
    auto r = run(cmd);
    ASSERT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    auto res = load_dict(op);
    const std::string what = c.algo + "/" + c.adapter;
    hp::testing::expect_close(res.at("out").toTensor(), lay(ref.out), what + " out");
    hp::testing::expect_close(res.at("dq").toTensor(), lay(ref.dq), what + " dq");
    hp::testing::expect_close(res.at("dk").toTensor(), lay(ref.dk), what + " dk");
    hp::testing::expect_close(res.at("dv").toTensor(), lay(ref.dv), what + " dv");
    // The last stdout line is the JSON report: measured bytes equal the formula on every rank.
    auto json = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"adapter\"")));
    EXPECT_EQ(json["algorithm"], c.algo);
    EXPECT_EQ(json["cp"], c.cp);
    ASSERT_EQ(json["comm_bytes_per_rank"].size(), static_cast<size_t>(c.cp));
    EXPECT_EQ(json["comm_bytes_per_rank"], json["comm_bytes_theory_per_rank"]) << r.out;
    EXPECT_GT(json["comm_bytes_theory"].get<int64_t>(), 0);
  }
}

// --kv-head-policy repeat: Ulysses over 4 ranks with 2 K/V heads equals the reference, with
// counted bytes equal to the formula; without the option the error names it.
TEST(HpCpRun, KVHeadRepeat) {
  const std::string dir = ::testing::TempDir();
  auto q = seeded(1, {1, 8, 48, 16}), k = seeded(2, {1, 2, 48, 16}), v = seeded(3, {1, 2, 48, 16}),
       dout = seeded(4, {1, 8, 48, 16});
  const auto ref = causal_reference(q, k, v, dout);
  c10::Dict<std::string, at::Tensor> in;
  in.insert("q", q);
  in.insert("k", k);
  in.insert("v", v);
  in.insert("dout", dout);
  const std::string ip = dir + "/kv_in.pt", op = dir + "/kv_out.pt";
  save_dict(ip, in);
  const std::string base = std::string(HP_CP_RUN_BINARY) + " --input " + ip + " --output " + op +
                           " --cp 4 --cp-algo ulysses --causal";
  auto refused = run(base);
  EXPECT_EQ(refused.rc, 1) << refused.out;
  EXPECT_NE(refused.out.find("set kv_head_policy=repeat (--kv-head-policy repeat)"),
            std::string::npos)
      << refused.out;
  for (const std::string schedule : {"sync", "async"}) {
    auto r = run(base + " --kv-head-policy repeat --schedule " + schedule);
    ASSERT_EQ(r.rc, 0) << r.out;
    auto res = load_dict(op);
    hp::testing::expect_close(res.at("out").toTensor(), ref.out, schedule + " out");
    hp::testing::expect_close(res.at("dq").toTensor(), ref.dq, schedule + " dq");
    hp::testing::expect_close(res.at("dk").toTensor(), ref.dk, schedule + " dk");
    hp::testing::expect_close(res.at("dv").toTensor(), ref.dv, schedule + " dv");
    auto json = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"adapter\"")));
    EXPECT_EQ(json["comm_bytes_per_rank"], json["comm_bytes_theory_per_rank"]) << r.out;
  }
}

// --cu-seqlens: packed documents (one of them shorter than a shard, others across shard
// boundaries) through ring with head-tail balance, async ulysses and usp equal every document
// run alone. The formula counts the unpacked layer: no rank sends more; the ring sends less
// (its routes end where no rank attends a chunk: rank 1's chunk of positions 12..23 reaches no
// query of rank 0's documents).
TEST(HpCpRun, PackedDocuments) {
  const std::string dir = ::testing::TempDir();
  auto q = seeded(11, {1, 4, 48, 8}), k = seeded(12, {1, 4, 48, 8}), v = seeded(13, {1, 4, 48, 8}),
       dout = seeded(14, {1, 4, 48, 8});
  auto ids = hp::attention::document_ids_from_cu_seqlens({0, 5, 29, 30, 48}, 48);
  auto q1 = q.clone().requires_grad_(true), k1 = k.clone().requires_grad_(true),
       v1 = v.clone().requires_grad_(true);
  auto ref = hp::testing::reference_packed_attention(q1, k1, v1, ids, true);
  ref.backward(dout.to(at::kDouble));
  c10::Dict<std::string, at::Tensor> in;
  in.insert("q", q);
  in.insert("k", k);
  in.insert("v", v);
  in.insert("dout", dout);
  const std::string ip = dir + "/packed_in.pt", op = dir + "/packed_out.pt";
  save_dict(ip, in);
  const std::string base = std::string(HP_CP_RUN_BINARY) + " --input " + ip + " --output " + op +
                           " --causal --cu-seqlens 0,5,29,30,48 ";
  for (const std::string args :
       {"--cp 2 --cp-algo ring --load-balance", "--cp 2 --cp-algo ulysses --schedule async",
        "--cp 4 --cp-algo usp --ulysses-degree 2"}) {
    auto r = run(base + args);
    ASSERT_EQ(r.rc, 0) << args << "\n" << r.out;
    auto res = load_dict(op);
    auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
    hp::testing::expect_close(res.at("out").toTensor(), f(ref.detach()), args + " out");
    hp::testing::expect_close(res.at("dq").toTensor(), f(q1.grad()), args + " dq");
    hp::testing::expect_close(res.at("dk").toTensor(), f(k1.grad()), args + " dk");
    hp::testing::expect_close(res.at("dv").toTensor(), f(v1.grad()), args + " dv");
    auto json = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"adapter\"")));
    EXPECT_EQ(json["documents"], 4) << r.out;
    const auto counted = json["comm_bytes_per_rank"].get<std::vector<int64_t>>(),
               bound = json["comm_bytes_theory_per_rank"].get<std::vector<int64_t>>();
    ASSERT_EQ(counted.size(), bound.size()) << r.out;
    for (size_t i = 0; i < counted.size(); ++i)
      EXPECT_LE(counted[i], bound[i]) << "rank " << i << "\n" << r.out;
    if (args.find("ring") != std::string::npos) {
      EXPECT_LT(counted[1], bound[1]) << r.out;
    }
  }
  auto refused = run(std::string(HP_CP_RUN_BINARY) + " --input " + ip + " --output " + op +
                     " --cp 2 --cu-seqlens 0,20,10");
  EXPECT_EQ(refused.rc, 1);
  EXPECT_NE(refused.out.find("cu_seqlens must increase strictly"), std::string::npos)
      << refused.out;
}

TEST(HpCpRun, RefusesWhatItDoesNotImplementAndBadInput) {
  const std::string dir = ::testing::TempDir();
  c10::Dict<std::string, at::Tensor> in;
  in.insert("q", at::randn({1, 4, 6, 8}));
  in.insert("k", at::randn({1, 4, 6, 8}));
  in.insert("v", at::randn({1, 4, 6, 8}));
  in.insert("dout", at::randn({1, 4, 6, 8}));
  save_dict(dir + "/bad_in.pt", in);
  const std::string base = std::string(HP_CP_RUN_BINARY) + " --input " + dir +
                           "/bad_in.pt --output " + dir + "/bad_out.pt";
  // Each refused before any compute (exit 1), the message naming what to change;
  // --ulysses-head-groups, --ulysses-row-parts, --ring-keep-blocks and --ring-backward reach the
  // configuration
  // (checked there).
  const std::pair<const char*, const char*> refused[] = {
      {" --cp 2 --schedule later", "cp schedule 'later' is not valid; valid: sync, async"},
      {" --cp 2 --cp-algo ulysses --load-balance",
       "load_balance=true requires algorithm=all_gather"},
      {" --cp 4", "sequence length 6 is not divisible by 4 (cp_size)"},
      {" --cp 2 --cp-algo ulysses --schedule async --ulysses-head-groups 3",
       "cp_config.ulysses_head_groups=3 does not divide"},
      {" --cp 2 --ring-keep-blocks",
       "cp_config.ring_keep_blocks=true applies to algorithm=ring or usp"},
      {" --cp 2 --ring-backward queries",
       "cp_config.ring_backward=queries applies to algorithm=ring or usp"},
      {" --cp 2 --cp-algo ring --ring-backward kv",
       "ring_backward 'kv' is not valid; valid: auto, blocks, queries"},
      {" --cp 2 --cp-algo ulysses --ulysses-row-parts 2",
       "cp_config.ulysses_row_parts=2 applies to algorithm=ulysses with schedule=async (got "
       "ulysses, sync)"},
      {" --cp 2 --load-balance-form data_order",
       "--load-balance-form data_order chooses how --load-balance shards; add --load-balance"},
      {" --cp 1 --cp-algo ring --load-balance --adapter flex_hf",
       "hp-cp-run: --cp-algo ring, --load-balance, --adapter flex_hf configure context "
       "parallelism, but --cp is 1"}};
  for (const auto& [flags, message] : refused) {
    auto r = run(base + flags);
    EXPECT_EQ(r.rc, 1) << flags;
    EXPECT_NE(r.out.find(message), std::string::npos) << flags << "\n" << r.out;
  }
  auto h = run(base + " --cp 2 --cp-algo ulysses --ulysses-degree 2 --adapter sdpa_qkv");
  EXPECT_EQ(h.rc, 0) << h.out;
  auto m = run(std::string(HP_CP_RUN_BINARY) + " --input " + dir + "/missing.pt --output x");
  EXPECT_NE(m.out.find("cannot open --input"), std::string::npos) << m.out;
}

// V with its own per-head size: the results equal the reference and the counted bytes the
// formula (which sized V like K), and the busiest rank's figure is the one reported. A file
// whose entries do not fit together is refused naming the file and the entry (it was cast
// silently, or failed inside autograd with a backtrace).
TEST(HpCpRun, ValueHeadSizeAndEntriesThatDoNotFit) {
  const std::string dir = ::testing::TempDir();
  auto q = seeded(1, {1, 3, 24, 8}), k = seeded(2, {1, 3, 24, 8}), v = seeded(3, {1, 3, 24, 12}),
       dout = seeded(4, {1, 3, 24, 12});
  const auto ref = causal_reference(q, k, v, dout);
  auto save = [&](const std::string& name, const at::Tensor& dq, const at::Tensor& dk,
                  const at::Tensor& dv, const at::Tensor& dd) {
    c10::Dict<std::string, at::Tensor> in;
    in.insert("q", dq);
    in.insert("k", dk);
    in.insert("v", dv);
    in.insert("dout", dd);
    save_dict(dir + "/" + name, in);
    return std::string(HP_CP_RUN_BINARY) + " --input " + dir + "/" + name + " --output " + dir +
           "/vdim_out.pt";
  };
  for (const std::string algo : {"all_gather", "ulysses", "ring"}) {
    auto r = run(save("vdim.pt", q, k, v, dout) + " --cp 3 --causal --cp-algo " + algo);
    ASSERT_EQ(r.rc, 0) << algo << "\n" << r.out;
    auto res = load_dict(dir + "/vdim_out.pt");
    hp::testing::expect_close(res.at("out").toTensor(), ref.out, algo + " out");
    hp::testing::expect_close(res.at("dv").toTensor(), ref.dv, algo + " dv");
    hp::testing::expect_close(res.at("dq").toTensor(), ref.dq, algo + " dq");
    auto json = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"adapter\"")));
    EXPECT_EQ(json["comm_bytes_per_rank"], json["comm_bytes_theory_per_rank"]) << algo << r.out;
    int64_t busiest = 0;
    for (const auto& b : json["comm_bytes_theory_per_rank"])
      busiest = std::max(busiest, b.get<int64_t>());
    EXPECT_EQ(json["comm_bytes_theory"], busiest) << algo;
  }
  const std::pair<std::string, std::string> bad[] = {
      {save("bad_dtype.pt", q, k, v, dout.to(at::kDouble)),
       "': dout is Double; q, k, v and dout must share one floating dtype (q is Float)"},
      {save("bad_dout.pt", q, k, v, dout.narrow(3, 0, 8)),
       "': dout is [1,3,24,8] but the output is [1,3,24,12] (q's shape with v's last dim)"},
      {save("bad_k.pt", q, k[0], v, dout), "': k must be 4-d (bnsd), got 3 dims"},
      {save("bad_int.pt", q.to(at::kLong), k, v, dout), "': q is Long; q, k, v and dout"}};
  for (const auto& [cmd, text] : bad) {
    auto r = run(cmd + " --cp 2");
    EXPECT_EQ(r.rc, 1) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find(text), std::string::npos) << cmd << "\n" << r.out;
    EXPECT_EQ(r.out.find("frame #"), std::string::npos) << r.out;
  }
}

// Output paths are checked before any compute and never leave a temporary file behind; input
// and output errors name the file.
TEST(HpCpRun, FileErrorsNameTheFileBeforeTheCompute) {
  namespace fs = std::filesystem;
  const std::string dir = hp::testing::scratch_dir() + "/cp_files";
  fs::remove_all(dir);
  fs::create_directories(dir + "/out_dir");
  c10::Dict<std::string, at::Tensor> in;
  for (const char* n : {"q", "k", "v", "dout"})
    in.insert(n, at::randn({1, 2, 8, 4}));
  save_dict(dir + "/in.pt", in);
  const std::string bin = std::string(HP_CP_RUN_BINARY) + " --cp 2 --input ";

  auto d = run(bin + dir + "/in.pt --output " + dir + "/out_dir");
  EXPECT_EQ(d.rc, 1) << d.out;
  EXPECT_NE(d.out.find("hp-cp-run: cannot write --output '" + dir + "/out_dir': it is a directory"),
            std::string::npos)
      << d.out;
  EXPECT_FALSE(fs::exists(dir + "/out_dir.tmp")) << "a temporary file was left beside it";
  EXPECT_EQ(d.out.find("{\"adapter\""), std::string::npos) << "nothing ran\n" << d.out;

  auto m = run(bin + dir + "/in.pt --output " + dir + "/no/such/out.pt");
  EXPECT_EQ(m.rc, 1) << m.out;
  EXPECT_NE(m.out.find("hp-cp-run: cannot write --output '" + dir +
                       "/no/such/out.pt': its directory '" + dir + "/no/such' does not exist"),
            std::string::npos)
      << m.out;

  std::ofstream(dir + "/not_pt.txt") << "q k v dout\n";
  auto t = run(bin + dir + "/not_pt.txt --output " + dir + "/o.pt");
  EXPECT_EQ(t.rc, 1) << t.out;
  EXPECT_NE(
      t.out.find("hp-cp-run: cannot read --input '" + dir + "/not_pt.txt' as a torch.save file"),
      std::string::npos)
      << t.out;
  auto i = run(bin + dir + "/out_dir --output " + dir + "/o.pt");
  EXPECT_EQ(i.rc, 1) << i.out;
  EXPECT_NE(i.out.find("hp-cp-run: cannot read --input '" + dir + "/out_dir': it is a directory"),
            std::string::npos)
      << i.out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    EXPECT_TRUE(name == "in.pt" || name == "out_dir" || name == "not_pt.txt")
        << name << " left behind";
  }
}

TEST(HpCpRun, CrossCheckAgainstPyTorch) {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "Debian's python3-torch is not installed";
  }
  const std::string dir = ::testing::TempDir();
  const std::string script = dir + "/cross_check.py";
  {
    std::ofstream f(script);
    f << R"PY(
import subprocess, sys, torch
torch.manual_seed(0)
B, Nq, Nkv, S, D = 1, 8, 2, 64, 32
q, k, v, dout = (torch.randn(B, n, S, D) for n in (Nq, Nkv, Nkv, Nq))
torch.save({"q": q, "k": k, "v": v, "dout": dout}, sys.argv[2] + "/py_in.pt")
ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
kr, vr = ref_k.repeat_interleave(Nq // Nkv, 1), ref_v.repeat_interleave(Nq // Nkv, 1)
s = ref_q @ kr.transpose(-2, -1) / D ** 0.5
s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
out = torch.softmax(s, -1) @ vr
out.backward(dout)
subprocess.run([sys.argv[1], "--input", sys.argv[2] + "/py_in.pt", "--output",
                sys.argv[2] + "/py_out.pt", "--cp", "4", "--cp-algo", "hybrid",
                "--ulysses-degree", "2", "--causal", "--adapter", "sdpa_hf"], check=True,
               stdout=subprocess.DEVNULL)
got = torch.load(sys.argv[2] + "/py_out.pt")
for name, ref in (("out", out), ("dq", ref_q.grad), ("dk", ref_k.grad), ("dv", ref_v.grad)):
    err = (got[name] - ref).abs().max().item()
    print(name, err)
    assert err < 1e-5, name
)PY";
  }
  auto r = run("/usr/bin/python3 " + script + " " + HP_CP_RUN_BINARY + " " + dir);
  EXPECT_EQ(r.rc, 0) << r.out;
}

}  // namespace
