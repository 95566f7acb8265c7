// Internal to train/: a per-rank step whose failure every rank learns of.
#pragma once

#include <functional>

#include "hp/comm/world.h"

namespace hp::train {

// Runs `fn` on this rank, then agrees on the outcome over `world` (one all-reduce): when `fn`
// threw on any rank, every rank throws hp::Error with the lowest failed rank's message (its first
// 2048 bytes). So no rank waits in a later collective for one that failed, and whichever rank
// exits first reports the cause.
void run_agreed(const comm::World& world, const std::function<void()>& fn);

}  // namespace hp::train
