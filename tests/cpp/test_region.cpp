// The region engine driven from pure C++: ops recorded through the key
// adapter, saved tensors packed and unpacked by hand as autograd's hooks
// would, dropped tensors rebuilt by replay.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <optional>

#include "csrc/core/interceptor.h"
#include "csrc/core/region/region.h"
#include "policies/builtin_policies.h"
#include "tests/cpp/key_adapter_test.h"

namespace torch_sac::region {
namespace {

class RegionEngine : public KeyAdapterTest {
 protected:
  static std::shared_ptr<Region> make_region(std::shared_ptr<OpPolicy> policy) {
    return std::make_shared<Region>(std::move(policy), /*allow_cache_entry_mutation=*/false);
  }
};

TEST_F(RegionEngine, DroppedChainIsRebuiltByReplay) {
  auto region = make_region(policies::recompute_all());
  const auto x = at::randn({8, 8}).requires_grad_();
  at::Tensor expected;
  std::optional<SavedActivation> saved;
  {
    KeyAdapterScope scope(region);
    auto b = x.sin().exp();
    expected = b.detach().clone();
    saved.emplace(region->pack(b));
  }
  region->close();
  // The originals are gone: unpacking must replay sin, then exp.
  const at::Tensor rebuilt = unpack(*saved);
  EXPECT_TRUE(at::equal(rebuilt, expected));
  EXPECT_EQ(region->stats().replayed_ops, 2);
  EXPECT_EQ(region->stats().packed_dropped, 1);
}

TEST_F(RegionEngine, LiveOriginalIsServedWithoutReplay) {
  auto region = make_region(policies::recompute_all());
  const auto x = at::randn({4}).requires_grad_();
  at::Tensor b;
  std::optional<SavedActivation> saved;
  {
    KeyAdapterScope scope(region);
    b = x.cos();
    saved.emplace(region->pack(b));
  }
  region->close();
  EXPECT_TRUE(at::equal(unpack(*saved), b));
  EXPECT_EQ(region->stats().replayed_ops, 0);
  EXPECT_EQ(region->stats().unpacked_original, 1);
}

TEST_F(RegionEngine, SavedOutputsAreKeptNotReplayed) {
  auto region = make_region(policies::save_ops({{"aten::mm", std::nullopt}}));
  const auto a = at::randn({4, 4}).requires_grad_();
  std::optional<SavedActivation> saved;
  at::Tensor expected;
  {
    KeyAdapterScope scope(region);
    auto m = at::mm(a, a);
    expected = m.detach().clone();
    saved.emplace(region->pack(m));
  }
  region->close();
  EXPECT_TRUE(saved->kept.defined());
  EXPECT_TRUE(at::equal(unpack(*saved), expected));
  EXPECT_EQ(region->stats().replayed_ops, 0);
}

TEST_F(RegionEngine, RandomOpsReplayTheSameDrawsAndLeaveTheGeneratorAlone) {
  auto region = make_region(policies::recompute_all());
  const auto x = at::ones({1000}).requires_grad_();
  at::Tensor expected;
  std::optional<SavedActivation> saved;
  {
    KeyAdapterScope scope(region);
    auto y = at::dropout(x, 0.5, /*train=*/true) * 3;
    expected = y.detach().clone();
    saved.emplace(region->pack(y));
  }
  region->close();
  // Other draws move the generator between forward and backward.
  (void)at::rand({4});
  auto generator = at::globalContext().defaultGenerator(c10::kCPU);
  const at::Tensor state = generator.get_state();
  EXPECT_TRUE(at::equal(unpack(*saved), expected));
  EXPECT_TRUE(at::equal(generator.get_state(), state)) << "replay moved the generator";
}

TEST_F(RegionEngine, WritesToOutsideTensorsAreNotRepeated) {
  auto region = make_region(policies::recompute_all());
  const auto x = at::randn({8, 3}).requires_grad_();
  auto running_mean = at::zeros({3});
  auto running_var = at::ones({3});
  at::Tensor expected;
  std::optional<SavedActivation> saved;
  {
    KeyAdapterScope scope(region);
    auto y = at::batch_norm(
                 x, {}, {}, running_mean, running_var, /*training=*/true,
                 /*momentum=*/0.1, /*eps=*/1e-5, /*cudnn_enabled=*/false)
                 .tanh();
    expected = y.detach().clone();
    saved.emplace(region->pack(y));
  }
  region->close();
  const at::Tensor mean_after_forward = running_mean.clone();
  EXPECT_FALSE(at::equal(mean_after_forward, at::zeros({3})));
  EXPECT_TRUE(at::equal(unpack(*saved), expected));
  EXPECT_GE(region->stats().replayed_ops, 2);
  EXPECT_TRUE(at::equal(running_mean, mean_after_forward))
      << "replay updated the running mean again";
}

TEST_F(RegionEngine, SecondPassReplaysAsMuchAsTheFirst) {
  auto region = make_region(policies::recompute_all());
  const auto x = at::randn({16}).requires_grad_();
  std::vector<SavedActivation> saved;
  {
    KeyAdapterScope scope(region);
    auto h = x;
    for (int i = 0; i < 6; ++i) {
      h = h.sin();
      saved.push_back(region->pack(h)); // as SinBackward saves its input
    }
  }
  region->close();
  auto backward_pass = [&] {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      (void)unpack(*it);
    }
  };
  backward_pass();
  const int64_t first = region->stats().replayed_ops;
  backward_pass(); // retain_graph=True: the same activations unpacked again
  EXPECT_EQ(first, 6);
  EXPECT_EQ(region->stats().replayed_ops - first, first);
}

TEST_F(RegionEngine, TapeIsFreedWithTheLastDroppedActivation) {
  auto region = make_region(policies::recompute_all());
  auto outside = at::randn({32}); // no grad: only the tape keeps it for replay
  const c10::weak_intrusive_ptr<c10::StorageImpl> outside_storage(
      outside.storage().getWeakStorageImpl());
  std::optional<SavedActivation> saved;
  const auto w = at::randn({32}).requires_grad_();
  {
    KeyAdapterScope scope(region);
    saved.emplace(region->pack(outside.sin() * w));
  }
  region->close();
  outside.reset();
  EXPECT_FALSE(outside_storage.expired()) << "the tape must hold what replay needs";
  saved.reset(); // autograd frees the node
  EXPECT_TRUE(outside_storage.expired()) << "the tape outlived the last dropped activation";
  EXPECT_GT(region->stats().dropped_ops, 0) << "stats outlive the tape";
}

TEST_F(RegionEngine, ChangedOutsideInputIsAnErrorNamingTheOp) {
  auto region = make_region(policies::recompute_all());
  auto outside = at::randn({4});
  const auto w = at::randn({4}).requires_grad_();
  std::optional<SavedActivation> saved;
  {
    KeyAdapterScope scope(region);
    saved.emplace(region->pack((outside * w).exp()));
  }
  region->close();
  outside.add_(1);
  try {
    (void)unpack(*saved);
    FAIL() << "replay used a modified input";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("modified by an inplace operation"), std::string::npos) << message;
    EXPECT_NE(message.find("aten::mul"), std::string::npos) << message;
  }
}

TEST_F(RegionEngine, NothingIsRecordedWhenEnteredWithGradDisabled) {
  const auto x = at::randn({4}).requires_grad_();
  at::NoGradGuard no_grad;
  auto region = make_region(policies::recompute_all());
  {
    KeyAdapterScope scope(region);
    (void)x.sin();
  }
  EXPECT_EQ(region->stats().policy_calls, 0);
}

TEST_F(RegionEngine, NoGradIslandInsideARegionIsRecorded) {
  // As in PyTorch's SAC: a custom Function's body runs with grad off, and
  // what it makes may be saved for backward.
  auto region = make_region(policies::recompute_all());
  const auto x = at::randn({4}).requires_grad_();
  {
    KeyAdapterScope scope(region);
    at::NoGradGuard no_grad;
    (void)x.sin();
  }
  EXPECT_EQ(region->stats().policy_calls, 1);
  EXPECT_EQ(region->stats().dropped_ops, 1);
}

} // namespace
} // namespace torch_sac::region
