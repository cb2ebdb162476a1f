#include "csrc/core/region/replay_budget.h"

#include <algorithm>
#include <mutex>

namespace torch_sac::region {
namespace {

// More checkpoints than this per replay buy nothing measurable: even a
// chain of 1024 blocks gets one per block.
constexpr size_t kMaxCheckpoints = 1024;

// The cheapest cut in each of k windows of equal cost; their indices and
// total bytes.
std::pair<std::vector<size_t>, int64_t> spaced(
    const std::vector<ReplayCut>& cuts,
    double total_cost,
    size_t k) {
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

// The fewest steps to reverse a chain of equal steps (serve x_l, ..., x_1
// from x_0, at most s tensors held, the one handed over included):
//   T(l, s) = min(l + T(l-1, s), min_p p + T(l-p, s-1) + T(p-1, s))
// and the p that attains it (0: keep nothing on the way). Filled once per
// process up to the sizes asked for (kMaxOptimalSteps^2 * slots at most).
class ReversalTable {
 public:
  // First checkpoint of the optimal reversal of (length, slots), or 0.
  size_t first_checkpoint(size_t length, size_t slots) {
    std::lock_guard<std::mutex> lock(mutex_);
    grow(length, slots);
    return choice_[slots][length];
  }

 private:
  void grow(size_t length, size_t slots) {
    if (slots < cost_.size() && length < cost_[0].size()) {
      return;
    }
    const size_t l_max = std::max(length + 1, cost_.empty() ? 0 : cost_[0].size());
    const size_t s_max = std::max(slots + 1, cost_.size());
    cost_.assign(s_max, std::vector<int64_t>(l_max, 0));
    choice_.assign(s_max, std::vector<size_t>(l_max, 0));
    for (size_t s = 1; s < s_max; ++s) {
      for (size_t l = 1; l < l_max; ++l) {
        int64_t best = static_cast<int64_t>(l) + cost_[s][l - 1];
        size_t choice = 0;
        for (size_t p = 1; s >= 2 && p < l; ++p) {
          const int64_t c = static_cast<int64_t>(p) + cost_[s - 1][l - p] + cost_[s][p - 1];
          if (c < best) {
            best = c;
            choice = p;
          }
        }
        cost_[s][l] = best;
        choice_[s][l] = choice;
      }
    }
  }

  std::mutex mutex_;
  std::vector<std::vector<int64_t>> cost_;  // [slots][length]
  std::vector<std::vector<size_t>> choice_; // [slots][length]
};

// Chains longer than this (in cuts) use the spaced heuristic: the table is
// quadratic in it.
constexpr size_t kMaxOptimalSteps = 512;

// Cuts of one size: the checkpoints the optimal reversal keeps on its first
// sweep (each kept cut starts a sub-reversal with one slot fewer, whose own
// first checkpoint is kept on the same sweep).
std::vector<size_t> optimal_first_sweep(size_t cuts, size_t slots) {
  static ReversalTable table;
  std::vector<size_t> picked;
  size_t base = 0; // steps: cut k ends step k + 1; the target ends step cuts + 1
  size_t length = cuts + 1;
  while (slots >= 2 && length > 1) {
    if (slots >= length) {
      for (size_t step = base + 1; step < base + length; ++step) {
        picked.push_back(step - 1);
      }
      break;
    }
    const size_t p = table.first_checkpoint(length, slots);
    if (p == 0) {
      break;
    }
    picked.push_back(base + p - 1);
    base += p;
    length -= p;
    --slots;
  }
  return picked;
}

// The cuts that hold something (a cut crossing only the tensor being handed
// over costs nothing and is no checkpoint), when they are of one size
// (within 1/8): a chain of equal steps, a transformer's residual stream.
// Empty otherwise.
std::vector<size_t> cuts_of_one_size(const std::vector<ReplayCut>& cuts) {
  std::vector<size_t> holding;
  int64_t smallest = 0;
  int64_t largest = 0;
  for (size_t i = 0; i < cuts.size(); ++i) {
    if (cuts[i].bytes > 0) {
      smallest = holding.empty() ? cuts[i].bytes : std::min(smallest, cuts[i].bytes);
      largest = std::max(largest, cuts[i].bytes);
      holding.push_back(i);
    }
  }
  if (holding.empty() || holding.size() >= kMaxOptimalSteps || largest - smallest > smallest / 8) {
    return {};
  }
  return holding;
}

} // namespace

CheckpointChoice choose_checkpoints(
    const std::vector<ReplayCut>& cuts,
    double total_cost,
    int64_t free_bytes,
    int64_t tail_bytes,
    double checkpoint_share) {
  if (cuts.empty() || total_cost <= 0 || free_bytes <= 0) {
    return {};
  }
  const std::vector<size_t> chain = cuts_of_one_size(cuts);
  if (!chain.empty()) {
    // One size (a chain of equal steps, a transformer's residual stream):
    // the optimal reversal, counting in steps between cuts, with what is
    // free after the tail the next unpacks need.
    int64_t largest = 0;
    for (size_t i : chain) {
      largest = std::max(largest, cuts[i].bytes);
    }
    const int64_t for_cuts = free_bytes - tail_bytes;
    const size_t slots = for_cuts <= 0 ? 1 : 1 + static_cast<size_t>(for_cuts / largest);
    CheckpointChoice choice;
    for (size_t k : optimal_first_sweep(chain.size(), slots)) {
      choice.cuts.push_back(chain[k]);
    }
    return choice;
  }
  // The most windows whose cuts fit in the share of what is free (a binary
  // search: more windows pick more bytes, up to ties).
  const auto allowance = static_cast<int64_t>(static_cast<double>(free_bytes) * checkpoint_share);
  CheckpointChoice choice;
  choice.spaced = std::any_of(cuts.begin(), cuts.end(), [](const ReplayCut& cut) {
    return cut.bytes > 0;
  });
  std::vector<size_t>& best = choice.cuts;
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
    // Too tight for checkpoints in the share: one checkpoint (in the
    // window around the middle, at its later end) shortens the replays of a
    // chain more than one more tensor kept at its end.
    auto [picked, bytes] = spaced(cuts, total_cost, 1);
    if (bytes <= free_bytes) {
      best = std::move(picked);
    }
  }
  return choice;
}

} // namespace torch_sac::region
