#include "hf_io.h"

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "agree.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/model/hf.h"

namespace hp::train {

void load_hf_checkpoint(Runner& run, const plan::ShardingPlan* plan, const std::string& dir) {
  const auto& c = run.o.model;
  model::check_hf_compatible(c);
  model::HFDirectory hf(dir);
  std::vector<std::string> names;
  for (const auto& p : run.model->named_parameters())
    names.push_back(p.key());
  model::check_no_unread_tensors(hf, c, names);
  // The model's parameters keep their TP-local shape under HSDP: x tp in the TP dim is the whole.
  std::map<std::string, std::vector<int64_t>> whole;
  for (const auto& p : run.model->named_parameters()) {
    auto shape = p.value().sizes().vec();
    if (plan != nullptr) {
      if (auto d = plan->tp_shard_dim(p.key())) shape[*d] *= run.mesh.size("tp");
    }
    whole[p.key()] = std::move(shape);
  }
  for (auto& [name, t] : run.params) {
    model::HFSlice s;
    if (auto it = whole.find(name); it != whole.end()) s.full_shape = it->second;
    const bool expert = plan != nullptr && plan->is_expert_param(name);
    if (plan != nullptr) {
      if (auto d = plan->tp_shard_dim(name)) {
        s.tp_dim = *d;
        s.tp_rank = run.mesh.coordinate("tp");
        s.tp_size = run.mesh.size("tp");
      }
      if (expert) s.expert_begin = plan->ep_group->rank() * t.size(0);
    }
    if (run.fully_shard != nullptr && !expert) {
      s.row_begin = run.fully_shard->shard_first_row(name);
      s.rows = run.fully_shard->shard_valid_rows(name);
    }
    model::load_hf_parameter(hf, c, name, s, t);
  }
}

void export_hf_checkpoint(const comm::World& world, Runner& run, const plan::ShardingPlan& plan,
                          const std::string& dir) {
  const auto& c = run.o.model;
  model::check_hf_compatible(c);
  const bool writer = world.rank() == 0;
  const int64_t tp = run.mesh.size("tp");
  // The global shape of every parameter (the model's parameters keep their TP-local shape under
  // HSDP), and the Hugging Face tensors it becomes.
  std::vector<model::SafetensorsEntry> entries;
  const auto params = run.model->named_parameters();
  for (const auto& p : params) {
    auto shape = p.value().sizes().vec();
    if (auto d = plan.tp_shard_dim(p.key())) shape[*d] *= tp;
    const auto names = model::hf_names(p.key(), c);
    if (model::is_stacked_experts(p.key())) {
      for (const auto& n : names)
        entries.push_back({n, at::kFloat, {shape.begin() + 1, shape.end()}});
    } else {
      entries.push_back({names.front(), at::kFloat, shape});
    }
  }
  // Only rank 0 writes, between collectives every rank runs: a failed write is held until the
  // end, where every rank learns of it (a rank 0 that threw at once would leave the others
  // waiting in the next gather).
  std::unique_ptr<model::SafetensorsWriter> w;
  run_agreed(world, [&] {
    if (!writer) return;
    std::filesystem::create_directories(dir);
    w = std::make_unique<model::SafetensorsWriter>(
        (std::filesystem::path(dir) / "model.safetensors").string(), entries);
  });
  std::string write_error;
  for (const auto& p : params) {
    const auto& name = p.key();
    const bool expert = plan.is_expert_param(name);
    at::Tensor full = run.fully_shard != nullptr && !expert
                          ? run.fully_shard->full_parameter(name)  // collective (shard group)
                          : p.value().detach();
    if (auto d = plan.tp_shard_dim(name); d && tp > 1) {
      full = comm::all_gather(run.mesh.group("tp"), full.contiguous(), *d);
    }
    if (expert && plan.ep_group && plan.ep_group->size() > 1) {
      full = comm::all_gather(*plan.ep_group, full.contiguous(), 0);
    }
    if (!writer || !write_error.empty()) continue;
    try {
      if (model::is_stacked_experts(name)) {
        for (int64_t e = 0; e < full.size(0); ++e)
          w->write(full[e]);
      } else {
        w->write(full);
      }
    } catch (const std::exception& e) {
      write_error = e.what();
    }
  }
  run_agreed(world, [&] {
    if (!writer) return;
    HP_CHECK(write_error.empty(), "hp-train --export-hf '", dir, "': ", write_error);
    w->close();
    model::write_hf_config(c, dir);
    std::printf("hp-train: exported the model to %s (Hugging Face %s, %zu tensors)\n", dir.c_str(),
                c.experts > 0 ? "qwen3_moe" : "qwen3", entries.size());
    std::fflush(stdout);
  });
}

}  // namespace hp::train
