#pragma once
// Which rebuilt tensors a replay keeps when the region has a replay budget.
//
// A replay rebuilds a dropped tensor by re-running the tape from the nearest
// tensors the region still has. Tensors it rebuilds on the way that autograd
// will unpack later in this backward ("candidates") are kept for those
// unpacks unless the budget says otherwise; a candidate not kept is rebuilt
// again when autograd asks for it, from the nearest kept tensors before it
// (multiple recomputation). With a budget of b bytes the region holds at most
// b bytes of rebuilt tensors between unpacks (the tensor being returned
// counts; the transient tensors of one replay, freed at their last use in it
// as in forward, do not).
//
// The choice, with `free` bytes left under the budget:
//  * everything fits: keep everything (no tensor is rebuilt twice);
//  * cuts of one size: the checkpoints of the optimal reversal of a chain of
//    equal steps (see choose_checkpoints), after reserving the tail;
//  * otherwise, up to half of `free` (the checkpoint share) goes to
//    checkpoints: cuts of the replay
//    (points where every rebuilt tensor that later ops read is a candidate,
//    so keeping those few tensors lets a later replay start there: a
//    transformer's residual stream between blocks, not its attention
//    scores), spaced evenly by replay cost, the cheapest cut in each window;
//    if no checkpoint fits in half, one in the middle may use all of it;
//  * the rest goes to the candidates nearest the returned tensor, which
//    autograd unpacks next (backward runs in reverse), latest first.
// Applied at every rebuild, the optimal-reversal path is the optimal schedule
// for a chain of equal steps (tests/python/test_replay_budget.py checks it
// against an independent DP); the spaced path is recursive bisection with a
// dense tail. docs/design.md, "Replay budget".

#include <cstddef>
#include <cstdint>
#include <vector>

namespace torch_sac::region {

// The spaced heuristic's share of what is free, by default.
constexpr double kDefaultCheckpointShare = 0.5;

// A point of the replay between two ops where keeping `bytes` (the rebuilt
// tensors produced before it and read after it) lets later replays start.
struct ReplayCut {
  double cost = 0; // replay cost up to the cut (replay_cost.h's estimate)
  int64_t bytes = 0;
};

// The cuts to keep as checkpoints, ascending, and whether the spaced
// heuristic chose them (cuts that hold something, of several sizes) rather
// than the optimal reversal.
struct CheckpointChoice {
  std::vector<std::size_t> cuts;
  bool spaced = false;
};

// Cuts in replay order (non-decreasing cost), the replay's total cost, the
// bytes free under the budget and the bytes of the tail after the last cut
// (what the unpacks right after this one need): which cuts to keep as
// checkpoints.
//  * Cuts of one size (within 1/8): the checkpoints the optimal reversal of
//    a chain of equal steps keeps on this sweep (the recursion of Revolve),
//    with what is free after the tail.
//  * Otherwise, spaced: at most `checkpoint_share` of free_bytes (all of it
//    for a single cut when none fits in that share). Which share is best
//    depends on the program: keeping a transformer's whole residual stream
//    leaves less for the blocks autograd needs next (a peak plan tries
//    several, torch_sac/planners/peak_search.py).
CheckpointChoice choose_checkpoints(
    const std::vector<ReplayCut>& cuts,
    double total_cost,
    int64_t free_bytes,
    int64_t tail_bytes = 0,
    double checkpoint_share = kDefaultCheckpointShare);

} // namespace torch_sac::region
