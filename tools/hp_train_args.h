// hp-train's command line: every option (and --config) into Args, which resolve() in
// hp_train.cpp checks and turns into the trainer's options.
#pragma once

#include <cstdint>
#include <string>

#include "hp/comm/world.h"
#include "hp/cp/config.h"
#include "hp/train/trainer.h"

namespace CLI {
class App;
}

namespace hp_train {

// Embedded default: the copy task on a model small enough that 200 steps take well under a
// minute on 2 cores (the loss falls from ~3.4 to ~0.001 once attention spans S/2 back).
hp::train::TrainOptions embedded_task();

// Everything the command line (and --config) sets: the trainer's options and the flags that
// become them once checked (resolve()).
// The CP flags (--cp-algo, --schedule, ...) are the base's.
struct Args : hp::cp::CPFlags {
  hp::train::TrainOptions train = embedded_task();
  int nproc = 1;
  std::string config_file;
  bool auto_algo = false;
  bool schedule_given = false;  // --schedule on the command line or in --config
  std::string nan_policy = "error", memory_limit;
  double timeout_s = static_cast<double>(hp::comm::kDefaultTimeout.count());
  int max_restarts = 0;
  std::string fusion = "off";
  std::string mode = "production";
  std::string attention = "softmax";
  std::string arch = "qwen3";
  double rotary_factor = 1;   // --partial-rotary-factor, where rotary_given
  bool rotary_given = false;  // else the family's factor
  // --experts / --layers on the command line or in --config (or the model from --init-from).
  bool experts_given = false, layers_given = false;
  std::string host_allocator = "caching";
  std::string moe_renormalize = "auto";  // --moe-renormalize on | off | auto
};

// Every option of hp-train on `app`, bound to `a`.
void add_options(CLI::App& app, Args& a);

// Values from --config FILE.json for every option not given on the command line.
void apply_config(CLI::App& app, const std::string& path);

// --init-from: the model's sizes (and family) come from the checkpoint's config.json; a size
// flag (or --init-weights, which would replace the weights) given beside it is refused rather
// than silently overridden.
void model_from_checkpoint(const CLI::App& app, Args& a);

}  // namespace hp_train
