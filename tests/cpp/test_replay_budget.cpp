// choose_checkpoints: where a replay under a budget keeps its checkpoints.

#include <gtest/gtest.h>

#include "csrc/core/region/replay_budget.h"

namespace torch_sac::region {
namespace {

std::vector<ReplayCut> uniform_cuts(int n, int64_t bytes) {
  std::vector<ReplayCut> cuts;
  for (int i = 1; i <= n; ++i) {
    cuts.push_back({static_cast<double>(i), bytes});
  }
  return cuts;
}

TEST(ReplayBudget, NothingFreeKeepsNothing) {
  EXPECT_TRUE(choose_checkpoints(uniform_cuts(8, 10), 9, 0).cuts.empty());
  EXPECT_TRUE(choose_checkpoints({}, 9, 100).cuts.empty());
}

TEST(ReplayBudget, CutsOfOneSizeFollowTheOptimalReversal) {
  // 15 cuts of 10 bytes (a chain of 16 equal steps), 30 bytes free: 4 slots
  // with the tensor handed over. The optimal reversal (T(16, 4) = 30 steps,
  // tests/python/chain_oracle.py) keeps these on its first sweep.
  EXPECT_EQ(choose_checkpoints(uniform_cuts(15, 10), 16, 30).cuts, (std::vector<size_t>{4, 8, 12}));
  EXPECT_EQ(choose_checkpoints(uniform_cuts(15, 10), 16, 10).cuts, (std::vector<size_t>{10}));
  // Room for every cut: all of them.
  EXPECT_EQ(choose_checkpoints(uniform_cuts(4, 10), 5, 1000).cuts.size(), 4u);
}

TEST(ReplayBudget, TheTailIsServedFirst) {
  // The 30 free bytes are all needed by the tail: no checkpoint.
  EXPECT_TRUE(choose_checkpoints(uniform_cuts(15, 10), 16, 30, /*tail_bytes=*/30).cuts.empty());
  EXPECT_EQ(
      choose_checkpoints(uniform_cuts(15, 10), 16, 40, /*tail_bytes=*/30).cuts,
      (std::vector<size_t>{10}));
}

TEST(ReplayBudget, PrefersTheCheapestCutInEachWindow) {
  // A block boundary (1 byte) every 4th cut among 100-byte cuts.
  std::vector<ReplayCut> cuts;
  for (int i = 1; i <= 16; ++i) {
    cuts.push_back({static_cast<double>(i), i % 4 == 0 ? 1 : 100});
  }
  const CheckpointChoice choice = choose_checkpoints(cuts, 17, 8);
  EXPECT_TRUE(choice.spaced);
  const auto& chosen = choice.cuts;
  ASSERT_FALSE(chosen.empty());
  for (size_t c : chosen) {
    EXPECT_EQ(cuts[c].bytes, 1) << "cut " << c;
  }
}

TEST(ReplayBudget, OneCheckpointWhenHalfFitsNone) {
  // Cuts of 10 and 12 bytes (not one size: spaced), 12 free: none fits in 6,
  // one fits in 12: the last in the window (2.5, 7.5] around the middle.
  std::vector<ReplayCut> cuts;
  for (int i = 1; i <= 9; ++i) {
    cuts.push_back({static_cast<double>(i), i % 2 ? 10 : 12});
  }
  const CheckpointChoice choice = choose_checkpoints(cuts, 10, 12);
  EXPECT_TRUE(choice.spaced);
  const auto& chosen = choice.cuts;
  ASSERT_EQ(chosen.size(), 1u);
  EXPECT_EQ(chosen[0], 6u);
}

} // namespace
} // namespace torch_sac::region
