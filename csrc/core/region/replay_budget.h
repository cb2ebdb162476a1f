#pragma once
// Which rebuilt tensors a replay keeps when the region has a replay budget.
//
// A replay rebuilds a dropped tensor by re-running the tape from the nearest
// tensors the region still has. Tensors it rebuilds on the way that autograd
// will unpack later in this backward ("candidates") are kept for those
// unpacks unless the budget says otherwise; a candidate not kept is rebuilt
// again when autograd asks for it, from the nearest kept tensor before it
// (multiple recomputation). With a budget of b bytes the region holds at most
// b bytes of rebuilt tensors between unpacks (the tensor being returned
// counts; the transient tensors of one replay, freed at their last use in it
// as in forward, do not).
//
// The choice, with `free` bytes left under the budget:
//  * everything fits: keep everything (no tensor is rebuilt twice);
//  * otherwise, up to half of `free` goes to checkpoints spaced evenly along
//    the replay by cost, the smallest candidate in each window (a
//    transformer's residual stream between blocks, not its attention
//    scores): later replays start there instead of at the region's start;
//  * the rest goes to the candidates nearest the returned tensor, which
//    autograd unpacks next (backward runs in reverse), latest first.
// Applied at every replay, this is recursive bisection with a dense tail:
// O(n log n) recompute for a chain of n equal steps when the budget holds
// only a few of them, and a single extra replay of each block for a chain of
// blocks whose boundaries are small. docs/design.md ("Replay budget") gives
// the measured gap to the optimal schedule (bench/bench_recompute.py).

#include <cstdint>
#include <vector>

namespace torch_sac::region {

struct MemoCandidate {
  // Replay cost from the start of the replay to the candidate's producer,
  // inclusive (any unit; forward time of the ops in practice).
  double cost = 0;
  int64_t bytes = 0;
};

// Candidates in tape order (non-decreasing cost). Returns, per candidate,
// whether to keep it; the kept bytes never exceed max(free_bytes, 0).
std::vector<bool> choose_memos(const std::vector<MemoCandidate>& candidates, int64_t free_bytes);

} // namespace torch_sac::region
