#include "hp/plan/memory.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>

#include "hp/common/check.h"

namespace hp::plan {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// A number from the first line of `path`; -1 when absent or not a number ("max").
int64_t read_number(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s.find_first_not_of("0123456789") != std::string::npos) return -1;
  try {
    return std::stoll(s);
  } catch (const std::exception&) {
    return -1;  // out of range: no limit
  }
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", b / (1024.0 * 1024 * 1024));
  } else if (b >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.0f MiB", b / (1024.0 * 1024));
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f KiB", b / 1024.0);
  }
  return buf;
}

std::string MemoryEstimate::describe() const {
  return common::str_cat(format_bytes(total()), " (parameters ", format_bytes(parameters),
                         ", gradients ", format_bytes(gradients), ", AdamW state ",
                         format_bytes(optimizer), ", activations ", format_bytes(activations),
                         ", transient ", format_bytes(transient), ", runtime ",
                         format_bytes(runtime), ")");
}

MemoryEstimate estimate_memory(const ModelFootprint& m, const PlanOptions& o) {
  const int64_t tp = std::max<int64_t>(1, o.tp_size), cp = std::max<int64_t>(1, o.cp_size);
  const int64_t e = m.element_size;
  const bool hsdp = hsdp_applies(o.dp_shard, o.dp_replicate, cp, tp);
  const int64_t shard = hsdp ? o.dp_shard * cp : 1;  // HSDP shard group: dp_shard x cp
  const int64_t ep = std::max<int64_t>(1, o.ep_size);
  int64_t tp_local = 0, largest_unit = 0, experts = 0;
  for (const auto& u : m.units) {
    // Experts split by EP (ep > 1) stay outside HSDP; with ep = 1 HSDP shards them with the rest.
    const int64_t local = ceil_div(u.tp_sharded, tp) + u.replicated + (ep > 1 ? 0 : u.expert);
    tp_local += local;
    largest_unit = std::max(largest_unit, local);
    if (ep > 1) experts += ceil_div(u.expert, ep);
  }
  MemoryEstimate est;
  const int64_t held = ceil_div(tp_local, shard) + experts;
  est.parameters = held * e;
  est.gradients = held * e;
  est.optimizer = 2 * held * e;

  // Activations of one micro-batch: tokens of this rank's sequence shard.
  const int64_t tokens =
      std::max<int64_t>(1, o.batch) * ceil_div(std::max<int64_t>(1, o.seq_len), cp);
  int64_t cp_extra = 0;  // per token and layer
  if (cp > 1) {
    std::string algo = "all_gather";
    std::optional<int64_t> degree;
    if (o.cp_config) {
      algo = o.cp_config->algorithm.name();
      degree = o.cp_config->ulysses_degree;
    }
    const int64_t u = std::max<int64_t>(1, degree.value_or(algo == "ulysses" ? cp : 1));
    const int64_t colossal = std::max<int64_t>(1, cp / u);
    if (u > 1) cp_extra += 2 * ceil_div(m.q_per_token + m.kv_per_token, tp);    // exchanged q/k/v/o
    if (colossal > 1) cp_extra += colossal * ceil_div(m.kv_per_token, tp * u);  // gathered K/V
  }
  const int64_t layer_full = ceil_div(m.layer_act_tp, tp) + m.layer_act + cp_extra;
  const int64_t kept = m.recompute ? m.layers * m.layer_input + layer_full : m.layers * layer_full;
  // + one layer's gradients of its activations while backward runs through it
  est.activations = tokens * (kept + layer_full + m.head_act) * e;

  // HSDP: two units gathered (prefetch) and one unit's unsharded gradients, during the steps.
  // Building comes before the steps: the planner's probe holds the whole model (no TP), then each
  // weight of the rank's model is built whole before TP slices it; it counts where it exceeds
  // the steps' own peak.
  const int64_t gathered = (hsdp ? 3 * largest_unit : 0) * e;
  int64_t full = 0;
  for (const auto& u : m.units)
    full += u.tp_sharded + u.replicated + u.expert;  // the probe builds every expert
  const int64_t build = std::max(full, tp_local + experts + m.largest_param) * e;
  const int64_t steps = est.parameters + est.gradients + est.optimizer + est.activations + gathered;
  est.transient = gathered + std::max<int64_t>(0, build - steps);
  est.runtime = kRuntimeBytes;
  return est;
}

MachineMemory machine_memory() {
  MachineMemory out;
  {
    std::ifstream f("/proc/meminfo");
    std::string key, unit;
    int64_t kb = 0, total = -1, available = -1;
    while (f >> key >> kb) {
      std::getline(f, unit);
      if (key == "MemTotal:") total = kb * 1024;
      if (key == "MemAvailable:") available = kb * 1024;
    }
    if (available > 0) {
      out = {available, "MemAvailable in /proc/meminfo"};
    } else if (total > 0) {
      out = {total, "MemTotal in /proc/meminfo"};
    }
  }
  // A cgroup limit below it (containers, Slurm): what is left of the limit.
  struct Limit {
    const char* max;
    const char* current;
  };
  for (const Limit l : {Limit{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
                        Limit{"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const int64_t max = read_number(l.max);
    if (max <= 0) continue;
    const int64_t left = max - std::max<int64_t>(0, read_number(l.current));
    if (left > 0 && (out.bytes == 0 || left < out.bytes)) {
      out = {left, common::str_cat("the cgroup limit ", l.max)};
    }
  }
  return out;
}

void check_memory(const MemoryEstimate& per_rank, int64_t ranks, const MachineMemory& available,
                  const std::string& tool, int64_t extra, const std::string& extra_what) {
  if (available.bytes <= 0) return;
  const int64_t need = per_rank.total() * ranks + extra;
  if (need <= available.bytes) return;
  const int64_t model =
      per_rank.parameters + per_rank.gradients + per_rank.optimizer + per_rank.transient;
  std::string advice =
      "the model dominates: reduce --hidden, --ffn, --layers or --vocab, or shard it over more "
      "ranks (--tp, --dp-shard)";
  if (per_rank.activations > model) {
    advice =
        "the activations dominate: reduce --seq-len, --batch or the model width (--hidden, "
        "--ffn), add --recompute, or split the sequence over more ranks (--cp)";
  }
  if (per_rank.runtime > std::max(model, per_rank.activations)) {
    advice = "each rank process alone needs about " + format_bytes(per_rank.runtime) +
             ": run fewer ranks on this machine (--nproc) or allow more memory";
  }
  HP_CHECK(false, tool, ": not enough memory: this layout needs about ", per_rank.describe(),
           " per rank", ranks > 1 ? common::str_cat(" x ", ranks, " ranks on this machine") : "",
           extra > 0 ? common::str_cat(" + ", format_bytes(extra), " for ", extra_what) : "", " = ",
           format_bytes(need), ", but ", format_bytes(available.bytes), " is available (",
           available.source, "); ", advice);
}

}  // namespace hp::plan
