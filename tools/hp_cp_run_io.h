// hp-cp-run's files: torch.save dicts in, a torch.load-able dict out. Shared by the attention
// run (hp_cp_run.cpp) and the mixer run (hp_cp_run_mixer.cpp). Every error names the file.
#pragma once

#include <functional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "hp/comm/world.h"
#include "hp/cp/topology.h"

namespace hp_cp_run {

// How the messages tell a user to make an input: `save` a torch.save call, `needs` the entries.
struct InputHint {
  const char* save;   // e.g. "torch.save({'q': q, 'k': k, 'v': v, 'dout': dout}, path)"
  const char* needs;  // e.g. "q, k, v and dout"
};

// The pickled object of a torch.save file.
c10::IValue load_file(const std::string& path, const InputHint& hint);
// The dict of a loaded file (an error when it holds something else).
c10::impl::GenericDict as_dict(const c10::IValue& file, const std::string& path,
                               const InputHint& hint);
// Entry `key` of the dict as a contiguous tensor.
at::Tensor entry(const c10::IValue& file, const std::string& key, const std::string& path,
                 const InputHint& hint);
// --output is checked before any compute: a writable file path.
void check_output(const std::string& path);
// Runs fn(world, topology) on `cp_size` thread ranks with one CP group of all of them (the
// mixer and MLA/DSA runs; a 120 s collective timeout).
void run_cp_thread_ranks(
    int cp_size, const std::function<void(hp::comm::World&, const hp::cp::CPTopology&)>& fn);
// Writes `d` to `path` for torch.load (temp file + rename; never a partial file).
void write_dict(const std::string& path, const c10::Dict<std::string, at::Tensor>& d);

}  // namespace hp_cp_run
