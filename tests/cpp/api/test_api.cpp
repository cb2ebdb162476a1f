// The public C++ API (#include <torch_sac/torch_sac.h>): every built-in
// policy, C++ callable policies, nesting, errors and threads. Gradients are
// checked bitwise against the same computation without checkpointing.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/interceptor.h"
#include "tests/cpp/api/gradients.h"
#include "torch_sac/torch_sac.h"

namespace torch_sac {
namespace {

// A transformer-ish block from plain ATen ops: matmuls, layer norm, GELU,
// dropout (random), softmax.
struct Params {
  at::Tensor w1, w2, gamma, beta;
  Params() {
    at::manual_seed(0);
    w1 = (at::randn({32, 64}) * 0.1).requires_grad_();
    w2 = (at::randn({64, 32}) * 0.1).requires_grad_();
    gamma = at::ones({32}).requires_grad_();
    beta = at::zeros({32}).requires_grad_();
  }
  std::vector<at::Tensor> all() const {
    return {w1, w2, gamma, beta};
  }
};

at::Tensor block(const Params& p, const at::Tensor& x) {
  auto h = at::layer_norm(x, {32}, p.gamma, p.beta);
  h = at::gelu(at::matmul(h, p.w1));
  h = at::dropout(h, 0.2, /*train=*/true);
  auto scores = at::softmax(at::matmul(h, p.w2), -1);
  return x + scores * x.tanh();
}

std::vector<at::Tensor> gradients(
    const Params& p,
    const std::function<at::Tensor(const at::Tensor&)>& forward) {
  return testing::step_gradients({8, 32}, p.all(), forward);
}

using testing::expect_bitwise_equal;

// `op` as the region names it: "aten::mm.default".
int64_t count_op(
    const std::vector<RegionOpSummary>& details,
    const std::string& op,
    int64_t RegionOpSummary::* field) {
  for (const auto& d : details) {
    if (d.op == op) {
      return d.*field;
    }
  }
  return 0;
}

class CppApi : public ::testing::Test {
 protected:
  Params params;
  std::vector<at::Tensor> reference() {
    return gradients(params, [&](const at::Tensor& x) { return block(params, x); });
  }
  // Gradients with one region around the block, and the region's record.
  std::vector<at::Tensor> with_region(const PolicyPtr& policy, RegionHandle* handle) {
    return gradients(params, [&](const at::Tensor& x) {
      SacContext region(policy);
      *handle = region.handle();
      return block(params, x);
    });
  }
};

TEST_F(CppApi, RecomputeAllDropsEverythingAndIsExact) {
  const auto expected = reference();
  RegionHandle handle;
  expect_bitwise_equal(with_region(policies::recompute_all(), &handle), expected);
  const RegionStats stats = handle.stats();
  EXPECT_EQ(stats.saved_ops, 0);
  EXPECT_GT(stats.dropped_ops, 0);
  EXPECT_GT(stats.replayed_ops, 0);
  // CPU dropout draws its mask with bernoulli_: replayed from forward's
  // generator state, hence the bitwise gradients.
  EXPECT_EQ(count_op(handle.op_details(), "aten::bernoulli_.float", &RegionOpSummary::replayed), 1);
}

TEST_F(CppApi, SaveAllDropsNothing) {
  const auto expected = reference();
  RegionHandle handle;
  expect_bitwise_equal(with_region(policies::save_all(), &handle), expected);
  EXPECT_EQ(handle.stats().dropped_ops, 0);
  EXPECT_EQ(handle.stats().replayed_ops, 0);
  EXPECT_GT(handle.stats().saved_ops, 0);
}

TEST_F(CppApi, SaveMatmulsKeepsMatmulsOnly) {
  const auto expected = reference();
  RegionHandle handle;
  expect_bitwise_equal(with_region(policies::save_matmuls(), &handle), expected);
  const auto details = handle.op_details();
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::saved), 2);
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::dropped), 0);
  EXPECT_GT(count_op(details, "aten::gelu.default", &RegionOpSummary::dropped), 0);
}

// The CPU stand-in for one test: every eligible tensor offloaded at once.
class CpuStandIn {
 public:
  CpuStandIn() : previous_(offload::options()) {
    offload::OffloadOptions o = previous_;
    o.cpu_stand_in = true;
    o.min_bytes = 0;
    o.keep_last_bytes = 0;
    offload::set_options(o);
  }
  ~CpuStandIn() {
    offload::set_options(previous_);
  }

 private:
  offload::OffloadOptions previous_;
};

TEST_F(CppApi, OffloadMatmulsIsExactAndLeavesNothingInTheHostPool) {
  const auto expected = reference();
  const CpuStandIn stand_in;
  const offload::OffloadStats before = offload::stats();
  RegionHandle handle;
  expect_bitwise_equal(with_region(policies::offload_matmuls(), &handle), expected);
  const auto details = handle.op_details();
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::offloaded), 2);
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::saved), 0);
  const offload::OffloadStats after = offload::stats();
  EXPECT_GT(after.offloaded_bytes, before.offloaded_bytes);
  EXPECT_GT(after.reloaded_bytes, before.reloaded_bytes);
  EXPECT_EQ(after.host.in_use_bytes, 0);
}

TEST_F(CppApi, CallablePolicyMayOffload) {
  const auto expected = reference();
  const CpuStandIn stand_in;
  RegionHandle handle;
  auto policy = policies::from_callable([](const OpCall& call) {
    return call.op.operator_name().name == "aten::gelu" ? Policy::MustOffload
                                                        : Policy::PreferRecompute;
  });
  expect_bitwise_equal(with_region(policy, &handle), expected);
  EXPECT_EQ(handle.stats().offloaded_ops, 1);
  // Dropout's replay reads gelu's output: the tape offloads it instead of holding it.
  EXPECT_GT(handle.stats().packed_offloaded + handle.stats().held_offloaded, 0);
}

TEST_F(CppApi, MustOffloadOnTheCpuRaisesNamingTheOp) {
  auto policy = policies::from_callable([](const OpCall& call) {
    return call.op.operator_name().name == "aten::gelu" ? Policy::MustOffload
                                                        : Policy::PreferRecompute;
  });
  try {
    RegionHandle handle;
    with_region(policy, &handle);
    FAIL() << "expected MUST_OFFLOAD of a CPU tensor to raise";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("aten::gelu"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CPU tensor"), std::string::npos) << e.what();
  }
  EXPECT_EQ(key_handler_depth(), 0u);
}

TEST_F(CppApi, SaveOpsByQualifiedName) {
  const auto expected = reference();
  RegionHandle handle;
  auto policy = policies::save_ops({policies::op("aten::gelu"), policies::op("aten::mm.default")});
  expect_bitwise_equal(with_region(policy, &handle), expected);
  const auto details = handle.op_details();
  EXPECT_EQ(count_op(details, "aten::gelu.default", &RegionOpSummary::saved), 1);
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::saved), 2);
  EXPECT_EQ(count_op(details, "aten::tanh.default", &RegionOpSummary::saved), 0);
}

TEST(CppApiPolicies, OpPatternsParseLikePythonOpOverloads) {
  EXPECT_FALSE(policies::op("aten::mm").overload.has_value());
  EXPECT_EQ(policies::op("aten::mm.default").overload, std::string());
  EXPECT_EQ(policies::op("aten::add.Tensor").overload, std::string("Tensor"));
  EXPECT_EQ(policies::op("aten::add.Tensor").name, "aten::add");
  EXPECT_THROW(policies::op("mm"), c10::ValueError);
  EXPECT_THROW(policies::op("aten::"), c10::ValueError);
}

TEST_F(CppApi, EveryNthSavesByCallIndex) {
  const auto expected = reference();
  RegionHandle handle;
  expect_bitwise_equal(
      with_region(policies::every_nth({policies::op("aten::mm")}, 2), &handle), expected);
  const auto details = handle.op_details();
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::saved), 1);   // call 0
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::dropped), 1); // call 1
}

TEST_F(CppApi, SaveByNameKeepsOpsInsideTheNamedScope) {
  const auto expected = gradients(params, [&](const at::Tensor& x) { return block(params, x); });
  RegionHandle handle;
  const auto got = gradients(params, [&](const at::Tensor& x) {
    SacContext region(policies::save_by_name({"mlp_in"}));
    handle = region.handle();
    at::Tensor h;
    {
      NameScope scope("mlp_in");
      h = at::layer_norm(x, {32}, params.gamma, params.beta);
      h = at::gelu(at::matmul(h, params.w1));
    }
    h = at::dropout(h, 0.2, /*train=*/true);
    auto scores = at::softmax(at::matmul(h, params.w2), -1);
    return x + scores * x.tanh();
  });
  expect_bitwise_equal(got, expected);
  const auto details = handle.op_details();
  EXPECT_EQ(count_op(details, "aten::gelu.default", &RegionOpSummary::saved), 1);
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::saved), 1);
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::dropped), 1);
  EXPECT_EQ(count_op(details, "aten::tanh.default", &RegionOpSummary::saved), 0);
}

TEST_F(CppApi, SaveCallsKeepsExactlyThePlannedCalls) {
  const auto expected = reference();
  RegionHandle handle;
  auto plan = policies::save_calls({{c10::OperatorName("aten::mm", ""), 1}}, "plan");
  expect_bitwise_equal(with_region(plan, &handle), expected);
  const auto details = handle.op_details();
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::saved), 1);
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::dropped), 1);
}

TEST_F(CppApi, CallablePolicySeesEachOpOnceWithItsOutputs) {
  const auto expected = reference();
  std::vector<std::string> seen;
  int64_t with_outputs = 0;
  auto policy = policies::from_callable([&](const OpCall& call) {
    seen.push_back(call.op.operator_name().name);
    with_outputs += call.outputs.empty() ? 0 : 1;
    return call.op.operator_name().name == "aten::softmax" ||
            call.op.operator_name().name == "aten::_softmax"
        ? Policy::MustSave
        : Policy::PreferRecompute;
  });
  RegionHandle handle;
  expect_bitwise_equal(with_region(policy, &handle), expected);
  EXPECT_EQ(static_cast<int64_t>(seen.size()), handle.stats().policy_calls)
      << "called once per op in forward, never in replay";
  EXPECT_EQ(with_outputs, static_cast<int64_t>(seen.size()));
  EXPECT_EQ(count_op(handle.op_details(), "aten::_softmax.default", &RegionOpSummary::saved), 1);
  EXPECT_GT(handle.stats().replayed_ops, 0);
}

TEST_F(CppApi, LambdaPolicyDirectlyAndCheckpointFunction) {
  const auto expected = reference();
  int64_t calls = 0;
  const auto got = gradients(params, [&](const at::Tensor& x) {
    return torch_sac::checkpoint(
        [&](const at::Tensor& input) { return block(params, input); }, x,
        PolicyFn([&](const OpCall&) {
          ++calls;
          return Policy::PreferRecompute;
        }));
  });
  expect_bitwise_equal(got, expected);
  EXPECT_GT(calls, 0);
  EXPECT_FALSE(in_sac_context());
}

TEST_F(CppApi, LambdasAreAcceptedWhereverAPolicyIs) {
  const auto expected = reference();
  auto save_mm = [](const OpCall& call) {
    return call.op.operator_name().name == "aten::mm" ? Policy::MustSave : Policy::PreferRecompute;
  };
  RegionHandle handle;
  const auto got = gradients(params, [&](const at::Tensor& x) {
    SacContext region(save_mm);
    handle = region.handle();
    return torch_sac::checkpoint(
        [&](const at::Tensor& in) { return block(params, in); }, x, save_mm);
  });
  expect_bitwise_equal(got, expected);
  EXPECT_EQ(count_op(handle.op_details(), "aten::mm.default", &RegionOpSummary::saved), 2);
}

TEST_F(CppApi, CheckpointTakesAListOfInputs) {
  const auto expected = reference();
  const auto got = gradients(params, [&](const at::Tensor& x) {
    std::vector<at::Tensor> inputs{x};
    return torch_sac::checkpoint(
        [&](const std::vector<at::Tensor>& in) { return block(params, in[0]); }, inputs,
        policies::save_matmuls());
  });
  expect_bitwise_equal(got, expected);
}

TEST_F(CppApi, NestedContextsStackPoliciesOnTheOuterRegion) {
  const auto expected = gradients(params, [&](const at::Tensor& x) {
    return block(params, x).sin();
  });
  RegionHandle outer_handle;
  bool inner_nested = false;
  const auto got = gradients(params, [&](const at::Tensor& x) {
    SacContext outer(policies::recompute_all());
    outer_handle = outer.handle();
    at::Tensor h;
    {
      // The inner MUST_SAVE beats the outer PREFER_RECOMPUTE for matmuls.
      SacContext inner(policies::save_ops({policies::op("aten::mm")}));
      inner_nested = inner.nested();
      h = block(params, x);
    }
    EXPECT_TRUE(in_sac_context());
    return h.sin();
  });
  expect_bitwise_equal(got, expected);
  EXPECT_TRUE(inner_nested);
  const auto details = outer_handle.op_details();
  EXPECT_EQ(count_op(details, "aten::mm.default", &RegionOpSummary::saved), 2);
  EXPECT_EQ(count_op(details, "aten::sin.default", &RegionOpSummary::dropped), 1)
      << "after the inner context exits, the outer policy decides again";
  EXPECT_FALSE(in_sac_context());
}

// A chain x_i = tanh(x_{i-1} @ w_i) of equal steps (8 x 16 floats each).
struct TanhChain {
  static constexpr int64_t kStepBytes = 8 * 16 * 4;
  std::vector<at::Tensor> weights;
  at::Tensor x;

  explicit TanhChain(int steps) {
    at::manual_seed(0);
    for (int i = 0; i < steps; ++i) {
      weights.push_back((at::randn({16, 16}) * 0.3).requires_grad_());
    }
    x = at::randn({8, 16});
  }

  // The weights' gradients of sum(x_n), in one region with `policy` and
  // `options` (none: plain autograd); `handle` gets the region.
  std::vector<at::Tensor> grads(
      PolicyPtr policy = nullptr,
      const SacOptions& options = {},
      RegionHandle* handle = nullptr) {
    std::optional<SacContext> region;
    if (policy) {
      region.emplace(std::move(policy), options);
      *handle = region->handle();
    }
    at::Tensor h = x;
    for (const at::Tensor& w : weights) {
      h = at::tanh(at::mm(h, w));
    }
    if (region) {
      region->exit();
    }
    h.sum().backward();
    std::vector<at::Tensor> out;
    for (const at::Tensor& w : weights) {
      out.push_back(w.grad().clone());
      w.mutable_grad().reset();
    }
    return out;
  }
};

// Under a replay budget of two steps' tensors: exact, within the budget,
// and some steps recomputed more than once.
TEST(CppApiReplayBudget, ChainRunsWithinItsBudgetAndExactly) {
  TanhChain chain(12);
  const auto expected = chain.grads();
  RegionHandle handle;
  SacOptions options;
  options.replay_budget = 2 * TanhChain::kStepBytes;
  expect_bitwise_equal(chain.grads(policies::recompute_all(), options, &handle), expected);
  const RegionStats stats = handle.stats();
  EXPECT_LE(stats.peak_memo_bytes, 2 * TanhChain::kStepBytes);
  EXPECT_GT(stats.memos_skipped, 0);
  int64_t most = 0;
  for (const auto& row : handle.op_details()) {
    if (row.op == "aten::tanh.default") {
      for (int64_t n : row.replays_by_call) {
        most = std::max(most, n);
      }
    }
  }
  EXPECT_GT(most, 1) << "no step was recomputed twice";
}

// Forward keeping every 4th mm's output: a budget that counts those leaves
// less room for rebuilt tensors (more replays), holds at most its bytes of
// both, and changes no gradient.
TEST(CppApiReplayBudget, BudgetCountingSavedOutputsBoundsThemToo) {
  TanhChain chain(16);
  const auto expected = chain.grads();
  RegionStats stats[2];
  for (bool counts_saved : {false, true}) {
    SacOptions options;
    options.replay_budget = 6 * TanhChain::kStepBytes;
    options.replay_budget_counts_saved = counts_saved;
    RegionHandle handle;
    expect_bitwise_equal(
        chain.grads(policies::every_nth({policies::op("aten::mm")}, 4), options, &handle),
        expected);
    stats[counts_saved] = handle.stats();
  }
  EXPECT_EQ(stats[true].saved_bytes, 4 * TanhChain::kStepBytes);
  EXPECT_LE(stats[true].peak_held_bytes, 6 * TanhChain::kStepBytes);
  EXPECT_GT(stats[true].peak_held_bytes, stats[true].peak_memo_bytes);
  EXPECT_GT(stats[true].replayed_ops, stats[false].replayed_ops);
}

TEST_F(CppApi, ReplayBudgetOnANestedContextRaises) {
  SacContext outer(policies::recompute_all());
  SacOptions options;
  options.replay_budget = 0;
  EXPECT_THROW(SacContext(policies::recompute_all(), options), c10::ValueError);
  EXPECT_TRUE(in_sac_context());
}

TEST_F(CppApi, ConflictingMustPoliciesRaiseAndLeaveNothingInstalled) {
  const auto x = at::randn({4, 4}).requires_grad_();
  try {
    SacContext outer(policies::from_callable([](const OpCall&) { return Policy::MustSave; }));
    SacContext inner(policies::from_callable([](const OpCall&) { return Policy::MustRecompute; }));
    (void)at::mm(x, x);
    FAIL() << "two different MUSTs must raise";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("aten::mm"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(in_sac_context());
  EXPECT_EQ(key_handler_depth(), 0u);
}

TEST_F(CppApi, ExceptionInsideARegionLeavesNothingInstalled) {
  const auto x = at::randn({4}).requires_grad_();
  RegionHandle handle;
  try {
    SacContext region(policies::recompute_all());
    handle = region.handle();
    (void)x.sin();
    throw std::runtime_error("user code failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(in_sac_context());
  EXPECT_EQ(key_handler_depth(), 0u);
  const int64_t calls = handle.stats().policy_calls;
  // Ops and saved tensors after the error are not the region's.
  auto y = x.exp().sum();
  EXPECT_EQ(handle.stats().policy_calls, calls);
  EXPECT_EQ(handle.stats().packed_dropped + handle.stats().packed_kept, 1);
  y.backward();
  EXPECT_TRUE(at::equal(x.grad(), x.exp()));
}

TEST_F(CppApi, PolicyThatThrowsLeavesNothingInstalled) {
  const auto x = at::randn({4}).requires_grad_();
  auto policy = policies::from_callable([](const OpCall& call) -> Policy {
    throw std::invalid_argument("policy refuses " + call.op.operator_name().name);
  });
  try {
    SacContext region(policy);
    (void)x.sin();
    FAIL() << "the policy's exception must propagate";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("policy refuses aten::sin"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(in_sac_context());
  EXPECT_EQ(key_handler_depth(), 0u);
}

TEST_F(CppApi, OutOfOrderExitRaisesAndExitsBoth) {
  auto outer = std::make_unique<SacContext>(policies::recompute_all());
  auto inner = std::make_unique<SacContext>(policies::save_all());
  EXPECT_THROW(outer->exit(), c10::Error);
  EXPECT_FALSE(in_sac_context());
  EXPECT_EQ(key_handler_depth(), 0u);
  inner.reset(); // already exited with the outer one: nothing to do, no warning
  outer.reset();
}

TEST_F(CppApi, StatsOutliveTheContextAndExitIsIdempotent) {
  const auto x = at::randn({8}).requires_grad_();
  SacContext region(policies::recompute_all());
  auto y = x.sin().exp().sum();
  region.exit();
  region.exit();
  EXPECT_FALSE(in_sac_context());
  y.backward();
  // ExpBackward's saved result was dropped: replay runs sin, then exp.
  EXPECT_EQ(region.stats().replayed_ops, 2);
}

TEST_F(CppApi, BackwardOnAnotherThread) {
  const auto expected = reference();
  RegionHandle handle;
  std::vector<at::Tensor> got;
  {
    at::manual_seed(1);
    const auto x = at::randn({8, 32}).requires_grad_();
    at::manual_seed(2);
    at::Tensor loss;
    {
      SacContext region(policies::save_matmuls());
      handle = region.handle();
      loss = block(params, x).pow(2).sum();
    }
    std::thread worker([&] { loss.backward(); });
    worker.join();
    got.push_back(x.grad().clone());
    for (const at::Tensor& t : params.all()) {
      got.push_back(t.grad().clone());
      t.mutable_grad().reset();
    }
  }
  expect_bitwise_equal(got, expected);
  EXPECT_GT(handle.stats().replayed_ops, 0);
}

TEST_F(CppApi, RegionsAreThreadLocal) {
  SacContext region(policies::recompute_all());
  bool other_thread_in_region = true;
  std::thread other([&] { other_thread_in_region = in_sac_context(); });
  other.join();
  EXPECT_FALSE(other_thread_in_region);
  EXPECT_TRUE(in_sac_context());
}

TEST_F(CppApi, RetainGraphReplaysAgain) {
  const auto x = at::randn({16}).requires_grad_();
  RegionHandle handle;
  at::Tensor loss;
  {
    SacContext region(policies::recompute_all());
    handle = region.handle();
    loss = x.sin().exp().sum();
  }
  loss.backward({}, /*retain_graph=*/true);
  const at::Tensor first = x.grad().clone();
  const int64_t replays = handle.stats().replayed_ops;
  loss.backward();
  EXPECT_TRUE(at::equal(x.grad(), first * 2));
  EXPECT_EQ(handle.stats().replayed_ops, 2 * replays);
}

TEST_F(CppApi, NothingIsRecordedWithGradDisabled) {
  const auto x = at::randn({4}).requires_grad_();
  at::NoGradGuard no_grad;
  SacContext region(policies::recompute_all());
  (void)x.sin();
  EXPECT_EQ(region.stats().policy_calls, 0);
}

TEST_F(CppApi, RecomputeAllLowersActivationMemory) {
  install_counting_allocator();
  auto activation_bytes = [&](const std::function<at::Tensor(const at::Tensor&)>& forward) {
    at::manual_seed(1);
    const auto x = at::randn({64, 32}).requires_grad_();
    const int64_t before = cpu_memory_stats().allocated;
    at::Tensor y = forward(x);
    const int64_t held = cpu_memory_stats().allocated - before - y.nbytes();
    y.pow(2).sum().backward();
    for (const at::Tensor& t : params.all()) {
      t.mutable_grad().reset();
    }
    return held;
  };
  const int64_t plain = activation_bytes([&](const at::Tensor& x) { return block(params, x); });
  const int64_t checkpointed = activation_bytes([&](const at::Tensor& x) {
    SacContext region(policies::recompute_all());
    return block(params, x);
  });
  EXPECT_LT(checkpointed, plain / 2)
      << "plain " << plain << " bytes, checkpointed " << checkpointed;
}

TEST(CppApiErrors, NullPolicyIsRejected) {
  EXPECT_THROW(SacContext{PolicyPtr{}}, c10::ValueError);
  EXPECT_THROW(SacContext{PolicyFn{}}, c10::ValueError);
  EXPECT_FALSE(in_sac_context());
}

TEST(CppApiVersion, VersionMacros) {
  // TORCH_SAC_VERSION is pyproject.toml's version (tests/python/test_c_stub.py
  // checks that); the numeric macros are its leading X.Y.Z.
  const std::string numeric = std::to_string(TORCH_SAC_VERSION_MAJOR) + "." +
      std::to_string(TORCH_SAC_VERSION_MINOR) + "." + std::to_string(TORCH_SAC_VERSION_PATCH);
  EXPECT_EQ(std::string(TORCH_SAC_VERSION).rfind(numeric, 0), 0u)
      << TORCH_SAC_VERSION << " does not start with " << numeric;
}

} // namespace
} // namespace torch_sac
