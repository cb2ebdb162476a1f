#include "replay_budget.h"

#include <algorithm>
#include <limits>

namespace torch_sac::region {
namespace {

// More checkpoints than this per replay buy nothing measurable: even a
// chain of 1024 blocks gets one per block.
constexpr size_t kMaxCheckpoints = 1024;

// The smallest candidate in each of k windows of equal cost; their indices
// (ascending, distinct) and total bytes.
std::pair<std::vector<size_t>, int64_t> spaced_checkpoints(
    const std::vector<MemoCandidate>& candidates, size_t k) {
  std::vector<size_t> picked;
  int64_t bytes = 0;
  const double total = candidates.back().cost;
  const double width = total / static_cast<double>(k + 1);
  size_t i = 0;
  for (size_t j = 1; j <= k; ++j) {
    const double low = (static_cast<double>(j) - 0.5) * width;
    const double high = (static_cast<double>(j) + 0.5) * width;
    while (i < candidates.size() && candidates[i].cost <= low) {
      ++i;
    }
    size_t best = candidates.size();
    for (; i < candidates.size() && candidates[i].cost <= high; ++i) {
      // Ties go to the later candidate: the next replay starts closer.
      if (best == candidates.size() || candidates[i].bytes <= candidates[best].bytes) {
        best = i;
      }
    }
    if (best != candidates.size()) {
      picked.push_back(best);
      bytes += candidates[best].bytes;
    }
  }
  return {std::move(picked), bytes};
}

} // namespace

std::vector<bool> choose_memos(const std::vector<MemoCandidate>& candidates, int64_t free_bytes) {
  const size_t n = candidates.size();
  std::vector<bool> keep(n, false);
  free_bytes = std::max<int64_t>(free_bytes, 0);
  int64_t total = 0;
  for (const MemoCandidate& c : candidates) {
    total += c.bytes;
  }
  if (total <= free_bytes) {
    std::fill(keep.begin(), keep.end(), true);
    return keep;
  }
  // The most evenly spaced checkpoints that fit in half of what is free
  // (a binary search: more windows pick more bytes, up to ties).
  int64_t used = 0;
  if (candidates.back().cost > 0) {
    const int64_t allowance = free_bytes / 2;
    size_t low = 1;
    size_t high = std::min(n, kMaxCheckpoints);
    std::vector<size_t> best;
    while (low <= high) {
      const size_t k = low + (high - low) / 2;
      auto [picked, bytes] = spaced_checkpoints(candidates, k);
      if (bytes <= allowance) {
        best = std::move(picked);
        used = bytes;
        low = k + 1;
      } else {
        high = k - 1;
      }
    }
    if (best.empty()) {
      // Too tight for checkpoints in half of it: one checkpoint in the middle
      // halves the replays of a chain more than keeping one tensor at its end.
      auto [picked, bytes] = spaced_checkpoints(candidates, 1);
      if (bytes <= free_bytes) {
        best = std::move(picked);
        used = bytes;
      }
    }
    for (size_t i : best) {
      keep[i] = true;
    }
  }
  // The tail autograd unpacks next, as far back as the rest allows.
  for (size_t i = n; i-- > 0;) {
    if (keep[i]) {
      continue;
    }
    if (used + candidates[i].bytes > free_bytes) {
      break;
    }
    keep[i] = true;
    used += candidates[i].bytes;
  }
  // Empty tensors cost nothing to keep.
  for (size_t i = 0; i < n; ++i) {
    keep[i] = keep[i] || candidates[i].bytes == 0;
  }
  return keep;
}

} // namespace torch_sac::region
