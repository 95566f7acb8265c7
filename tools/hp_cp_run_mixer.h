// hp-cp-run --mixer gdn|kda: one linear-attention mixer (cp/linear_mixer.h) forward/backward
// under CP over P ranks (threads in this process) on whole-sequence tensors from a torch.save
// file; writes whole-sequence results loadable by torch.load.
//
// IN.pt, a dict (BSHD):
//   q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (gdn) or [B, T, HV, K] (kda) natural-log
//   gates; beta [B, T, HV]; optional: initial_state [B, HV, K, V], dout like v (then gradients),
//   dfinal_state like initial_state (with dout).
// --cu-seqlens 0,L1,L1+L2,...: packed documents, global boundaries shared by every batch row;
// the state restarts at each (MixerInputs::resets, sharded with the tokens).
// OUT.pt: out, final_state; with dout also dq, dk, dv, dg, dbeta, and dinitial_state when an
// initial_state was given (the sum of the ranks' parts: the whole gradient).
// stdout: one JSON line: the configuration, comm_bytes_per_rank (counted from the transport),
// comm_bytes_theory(_per_rank) (linear_mixer_forward_bytes_per_rank, twice with a backward).
// Every name and shape is checked before any rank communicates.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace CLI {  // NOLINT(readability-identifier-naming): CLI11's namespace
class App;
}

namespace hp_cp_run {

struct MixerArgs {
  std::string input, output;
  int cp_size = 2;
  std::string mixer;  // gdn | kda; empty: the attention run
  std::string mode = "state_passing", exchange = "all_gather";
  std::optional<double> scale;
  int64_t chunk_size = 64;
  std::vector<int64_t> cu_seqlens;  // packed documents (hp-cp-run --cu-seqlens); empty: none
};

void add_mixer_options(CLI::App& app, MixerArgs& m);
// Whether --mixer was given; refuses a mixer flag without --mixer and an attention flag with it.
bool mixer_requested(const CLI::App& app, const MixerArgs& m);
int run_mixer(const MixerArgs& m);

}  // namespace hp_cp_run
