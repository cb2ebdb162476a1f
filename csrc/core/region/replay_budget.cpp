#include "replay_budget.h"

#include <algorithm>

namespace torch_sac::region {
namespace {

// More checkpoints than this per replay buy nothing measurable: even a
// chain of 1024 blocks gets one per block.
constexpr size_t kMaxCheckpoints = 1024;

// The cheapest cut in each of k windows of equal cost; their indices and
// total bytes.
std::pair<std::vector<size_t>, int64_t> spaced(
    const std::vector<ReplayCut>& cuts, double total_cost, size_t k) {
  std::vector<size_t> picked;
  int64_t bytes = 0;
  const double width = total_cost / static_cast<double>(k + 1);
  size_t i = 0;
  for (size_t j = 1; j <= k; ++j) {
    const double low = (static_cast<double>(j) - 0.5) * width;
    const double high = (static_cast<double>(j) + 0.5) * width;
    while (i < cuts.size() && cuts[i].cost <= low) {
      ++i;
    }
    size_t best = cuts.size();
    for (; i < cuts.size() && cuts[i].cost <= high; ++i) {
      // Ties go to the later cut: the replays after it, which come first in
      // backward, are shorter (measured: bench/bench_recompute.py, part 2).
      if (best == cuts.size() || cuts[i].bytes <= cuts[best].bytes) {
        best = i;
      }
    }
    if (best != cuts.size()) {
      picked.push_back(best);
      bytes += cuts[best].bytes;
    }
  }
  return {std::move(picked), bytes};
}

} // namespace

std::vector<size_t> choose_checkpoints(
    const std::vector<ReplayCut>& cuts, double total_cost, int64_t free_bytes) {
  if (cuts.empty() || total_cost <= 0 || free_bytes <= 0) {
    return {};
  }
  // The most windows whose cuts fit in half of what is free (a binary
  // search: more windows pick more bytes, up to ties).
  const int64_t allowance = free_bytes / 2;
  std::vector<size_t> best;
  size_t low = 1;
  size_t high = std::min(cuts.size(), kMaxCheckpoints);
  while (low <= high) {
    const size_t k = low + (high - low) / 2;
    auto [picked, bytes] = spaced(cuts, total_cost, k);
    if (bytes <= allowance) {
      best = std::move(picked);
      low = k + 1;
    } else {
      high = k - 1;
    }
  }
  if (best.empty()) {
    // Too tight for checkpoints in half of it: one checkpoint (in the
    // window around the middle, at its later end) shortens the replays of a
    // chain more than one more tensor kept at its end.
    auto [picked, bytes] = spaced(cuts, total_cost, 1);
    if (bytes <= free_bytes) {
      best = std::move(picked);
    }
  }
  return best;
}

} // namespace torch_sac::region
