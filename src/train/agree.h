// Internal to train/: a per-rank step whose failure every rank learns of.
#pragma once

#include <functional>
#include <string>

#include "hp/comm/world.h"

namespace hp::train {

// Runs `fn` on this rank, then agrees on the outcome over `world` (one all-reduce): when `fn`
// threw on any rank, every rank throws hp::Error with the lowest failed rank's message (its first
// 2048 bytes). So no rank waits in a later collective for one that failed, and whichever rank
// exits first reports the cause.
void run_agreed(const comm::World& world, const std::function<void()>& fn);

// Checks that `text` is the same on every rank of `world` (one all-reduce of its CRC-32), else
// throws hp::Error on every rank: "<what> differs between ranks (rank R's differs from rank
// 0's); this rank's: <text>. <fix>".
void check_same_on_every_rank(const comm::World& world, const std::string& text,
                              const std::string& what, const std::string& fix);

}  // namespace hp::train
