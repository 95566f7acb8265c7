// Internal to the ring and the byte formulas (strategy_ring.cpp, ring_queries_backward.cpp,
// volume.cpp): where a ring's chunks travel, and how the routes are chosen.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace hp::cp::detail::ring {

// Where the chunks of one kind travel (the sketch atop strategy_ring.cpp): all of them one way
// round, `dir` +1 (member r to r+1) or -1, each only as far as the last member on its way that
// attends it (causal: a head-tail tail chunk only to the members before it).
struct Routes {
  int dir = 1;
  int64_t size = 1;
  std::vector<std::vector<int64_t>> hops;  // [origin member][chunk] -> members it reaches, 0..P-1
  int64_t last = 0;                        // the largest hops: the ring's steps

  // The member whose chunks `rank` holds at `step` (step 0: its own).
  int64_t origin_at(int64_t rank, int64_t step) const {
    return ((rank - dir * step) % size + size) % size;
  }
  int64_t hops_of(int64_t origin, size_t c) const { return hops[static_cast<size_t>(origin)][c]; }
  // Chunk c of origin_at(rank, step) is at `rank` at `step` / goes on from there.
  bool here(int64_t rank, int64_t step, size_t c) const {
    return step <= hops_of(origin_at(rank, step), c);
  }
  bool moves_on(int64_t rank, int64_t step, size_t c) const {
    return step < hops_of(origin_at(rank, step), c);
  }
};

// The routes of a ring of chunks.size() members, member o holding chunks[o] chunks, where
// needs(d, o, c) tells whether member d attends chunk c of member o: for each direction the
// hops every chunk needs (to the last member on its way that attends it), and the direction
// with fewer in all (ties: `preferred`).
inline Routes route_chunks(const std::vector<size_t>& chunks,
                           const std::function<bool(int64_t, int64_t, size_t)>& needs,
                           int preferred) {
  const auto p = static_cast<int64_t>(chunks.size());
  auto routes_for = [&](int dir) {
    Routes out{dir, p, std::vector<std::vector<int64_t>>(chunks.size()), 0};
    for (int64_t o = 0; o < p; ++o) {
      for (size_t c = 0; c < chunks[static_cast<size_t>(o)]; ++c) {
        int64_t hops = 0;
        for (int64_t i = 1; i < p; ++i) {
          if (needs(((o + dir * i) % p + p) % p, o, c)) hops = i;
        }
        out.hops[static_cast<size_t>(o)].push_back(hops);
        out.last = std::max(out.last, hops);
      }
    }
    return out;
  };
  auto total = [](const Routes& r) {
    int64_t n = 0;
    for (const auto& h : r.hops) {
      for (int64_t x : h)
        n += x;
    }
    return n;
  };
  auto mine = routes_for(preferred), other = routes_for(-preferred);
  return total(other) < total(mine) ? other : mine;
}

}  // namespace hp::cp::detail::ring
