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
  EXPECT_TRUE(choose_checkpoints(uniform_cuts(8, 10), 9, 0).empty());
  EXPECT_TRUE(choose_checkpoints({}, 9, 100).empty());
}

TEST(ReplayBudget, UsesAtMostHalfOfWhatIsFreeEvenlySpaced) {
  // 16 equal cuts of 10 bytes, 80 free: at most 4 checkpoints (40 bytes).
  const auto chosen = choose_checkpoints(uniform_cuts(15, 10), 16, 80);
  ASSERT_EQ(chosen.size(), 4u);
  // Windows of width 16/5 around 3.2, 6.4, 9.6, 12.8: the last cut in each.
  EXPECT_EQ(chosen, (std::vector<size_t>{3, 7, 10, 13}));
}

TEST(ReplayBudget, PrefersTheCheapestCutInEachWindow) {
  // A block boundary (1 byte) every 4th cut among 100-byte cuts.
  std::vector<ReplayCut> cuts;
  for (int i = 1; i <= 16; ++i) {
    cuts.push_back({static_cast<double>(i), i % 4 == 0 ? 1 : 100});
  }
  const auto chosen = choose_checkpoints(cuts, 17, 8);
  ASSERT_FALSE(chosen.empty());
  for (size_t c : chosen) {
    EXPECT_EQ(cuts[c].bytes, 1) << "cut " << c;
  }
}

TEST(ReplayBudget, OneCheckpointWhenHalfFitsNone) {
  // 10 bytes free, cuts of 10: none fits in 5, one fits in 10: the last
  // in the window (2.5, 7.5] around the middle.
  const auto chosen = choose_checkpoints(uniform_cuts(9, 10), 10, 10);
  ASSERT_EQ(chosen.size(), 1u);
  EXPECT_EQ(chosen[0], 6u);
}

} // namespace
} // namespace torch_sac::region
