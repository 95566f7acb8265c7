// Shared by the hp-train end-to-end suites: running the binary, reading its metrics file, and
// checking its --validate result and its refusals.
#pragma once

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace hp::train_testing {

inline hp::testing::CommandResult run(const std::string& args) {
  return hp::testing::run_command(std::string(HP_TRAIN_BINARY) + " " + args);
}

inline bool contains(const std::string& out, const std::string& text) {
  return out.find(text) != std::string::npos;
}

// A fresh (removed, not created) directory under the scratch dir.
inline std::string fresh(const std::string& name) {
  std::string dir = hp::testing::scratch_dir() + "/" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

// Two CP ranks on the embedded task, short sequences: about a second per run.
inline const std::string kTiny = "--nproc 2 --cp 2 --seq-len 32 ";

inline nlohmann::json metrics(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

// The per-step losses of a metrics file; every one finite, steps numbered first, first + 1, ...
inline std::vector<double> losses(const nlohmann::json& j, size_t count, int64_t first = 1) {
  std::vector<double> out;
  const auto& steps = j.at("steps");
  EXPECT_EQ(steps.size(), count);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].at("step").get<int64_t>(), first + static_cast<int64_t>(i));
    out.push_back(steps[i].at("loss").get<double>());
    EXPECT_TRUE(std::isfinite(out.back())) << "step " << first + static_cast<int64_t>(i);
  }
  if (!out.empty()) {
    EXPECT_EQ(j.at("final_loss").get<double>(), out.back());
  }
  return out;
}

// What rank 0 prints after --validate:
//   hp-train: validate: max |loss - reference| over N steps = X; max relative gradient
//   difference after step K = Y  (K: the first step not skipped)
struct PrintedValidation {
  long long steps = -1, grad_step = -1;
  double loss_diff = -1, grad_diff = -1;
};
inline PrintedValidation printed_validation(const std::string& out) {
  PrintedValidation v;
  const auto at = out.find("hp-train: validate: ");
  if (at == std::string::npos) return v;
  if (std::sscanf(out.c_str() + at,
                  "hp-train: validate: max |loss - reference| over %lld steps = %lf; max relative "
                  "gradient difference after step %lld = %lf",
                  &v.steps, &v.loss_diff, &v.grad_step, &v.grad_diff) != 4) {
    v.steps = -1;
  }
  return v;
}

// --validate: both differences below `bound`, printed and in the metrics file (the same
// numbers, to the printed precision), over every step.
inline void expect_validated(const std::string& out, const nlohmann::json& j, long long steps,
                             double bound) {
  auto v = printed_validation(out);
  ASSERT_EQ(v.steps, steps) << "no validate line for " << steps << " steps in:\n" << out;
  EXPECT_LT(v.loss_diff, bound) << out;
  EXPECT_LT(v.grad_diff, bound) << out;
  const double loss_diff = j.at("validate").at("max_abs_loss_diff");
  const double grad_diff = j.at("validate").at("max_rel_grad_diff");
  EXPECT_NEAR(v.loss_diff, loss_diff, 1e-2 * loss_diff + 1e-12);
  EXPECT_NEAR(v.grad_diff, grad_diff, 1e-2 * grad_diff + 1e-12);
}

// A refusal: exit code 1, every text in the output, before any plan or collective.
inline void expect_refused(const std::string& args, const std::vector<std::string>& texts) {
  auto r = run(args);
  EXPECT_EQ(r.rc, 1) << args << "\n" << r.out;
  for (const auto& text : texts)
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << args << "\n" << r.out;
  EXPECT_EQ(r.out.find("hp-train: plan mesh"), std::string::npos) << args << "\n" << r.out;
  EXPECT_EQ(r.out.find(" on group '"), std::string::npos) << args << "\n" << r.out;
}

}  // namespace hp::train_testing
