// torch_sac::policies::budget: profiling a region in C++, the plan's
// accounting (aliasing, storages from outside, mutated outputs), its keys
// against the region's, gradients under the plan, errors, and what stays
// installed.

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>

#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "csrc/core/interceptor.h"
#include "tests/cpp/api/gradients.h"
#include "torch_sac/torch_sac.h"

namespace torch_sac {
namespace {

constexpr int64_t B = 4, T = 32, C = 64;

// An attention block from plain ATen ops: projections (at::linear, whose
// transposes of the weights keep no region memory), a causal mask made under
// no_grad (counted as the region counts it), softmax, dropout, an MLP whose
// GELU output is scaled in place.
struct Weights {
  at::Tensor wq, wk, wv, wo, w1, w2, gamma, beta;
  Weights() {
    at::manual_seed(0);
    auto init = [](int64_t in, int64_t out) {
      return (at::randn({out, in}) / std::sqrt(static_cast<double>(in))).requires_grad_();
    };
    wq = init(C, C);
    wk = init(C, C);
    wv = init(C, C);
    wo = init(C, C);
    w1 = init(C, 4 * C);
    w2 = init(4 * C, C);
    gamma = at::ones({C}).requires_grad_();
    beta = at::zeros({C}).requires_grad_();
  }
  std::vector<at::Tensor> all() const {
    return {wq, wk, wv, wo, w1, w2, gamma, beta};
  }
};

at::Tensor attention_block(const Weights& w, const at::Tensor& x) {
  auto h = at::layer_norm(x, {C}, w.gamma, w.beta);
  auto q = at::linear(h, w.wq), k = at::linear(h, w.wk), v = at::linear(h, w.wv);
  at::Tensor future;
  {
    at::NoGradGuard no_grad;
    future = at::ones({T, T}, at::kBool).triu(1);
  }
  auto scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(C));
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  auto att = at::dropout(at::softmax(scores, -1), 0.1, /*train=*/true);
  auto y = x + at::linear(at::matmul(att, v), w.wo);
  auto m = at::gelu(at::linear(y, w.w1));
  m.mul_(0.5);
  return y + at::linear(m, w.w2);
}

std::vector<at::Tensor> gradients(
    const Weights& w,
    const std::function<at::Tensor(const at::Tensor&)>& forward) {
  return testing::step_gradients({B, T, C}, w.all(), forward);
}

using testing::expect_bitwise_equal;

const PlannedCall* find_call(
    const BudgetPlan& plan,
    const std::string& op,
    int64_t call_index = 0) {
  for (const PlannedCall& call : plan.calls) {
    if (call.op.name == op && call.call_index == call_index) {
      return &call;
    }
  }
  return nullptr;
}

void expect_nothing_installed() {
  EXPECT_EQ(key_handler_depth(), 0u);
  EXPECT_FALSE(c10::impl::tls_is_dispatch_key_included(kInterceptKey));
  EXPECT_FALSE(in_sac_context());
  EXPECT_EQ(
      torch::autograd::Engine::get_default_engine().get_default_saved_variable_hooks(), nullptr);
}

class Budget : public ::testing::Test {
 protected:
  Weights weights;
  at::Tensor example = at::randn({B, T, C}).requires_grad_();

  BudgetPlan plan(BudgetOptions options) {
    return policies::budget([&] { return attention_block(weights, example); }, options);
  }
};

TEST_F(Budget, PlanForAnAttentionBlockFitsItsBudget) {
  const BudgetPlan p = plan({.fraction = 0.5});
  EXPECT_GT(p.activation_bytes, 0);
  EXPECT_EQ(p.budget_bytes, static_cast<int64_t>(0.5 * static_cast<double>(p.activation_bytes)));
  EXPECT_LE(p.saved_bytes, p.budget_bytes);
  EXPECT_FALSE(p.chosen.empty());
  EXPECT_TRUE(p.optimal);
  EXPECT_EQ(p.solver, budget::Method::Exact);
  EXPECT_LE(p.avoided_cost, p.total_cost);

  // Call indices count each op overload's calls in region order.
  std::unordered_map<c10::OperatorName, int64_t> next;
  for (const PlannedCall& call : p.calls) {
    EXPECT_EQ(call.call_index, next[call.op]++) << call.op.name;
    EXPECT_GT(call.cost, 0) << call.op.name << " was timed";
    EXPECT_LE(call.new_bytes, call.bytes);
    EXPECT_EQ(p.is_saved(call.op, call.call_index), call.saved);
    EXPECT_TRUE(call.saveable || !call.saved);
  }
  EXPECT_EQ(next[c10::OperatorName("aten::bmm", "")], 2) << "scores and att @ v";
  EXPECT_EQ(next[c10::OperatorName("aten::mm", "")], 6) << "q, k, v, out and the MLP";
  EXPECT_EQ(next.count(c10::OperatorName("aten::detach", "")), 0u) << "ignored ops get no index";

  // The GELU output is scaled in place later: saving it would hand back the
  // scaled values.
  const PlannedCall* gelu = find_call(p, "aten::gelu");
  ASSERT_NE(gelu, nullptr);
  EXPECT_FALSE(gelu->saveable);
  EXPECT_EQ(gelu->why_not, "output mutated in place later");
  const PlannedCall* scale = find_call(p, "aten::mul_");
  ASSERT_NE(scale, nullptr);
  EXPECT_FALSE(scale->saveable);
  EXPECT_EQ(scale->why_not, "in-place op");

  EXPECT_NE(p.summary().find("(50% of activations)"), std::string::npos) << p.summary();
  EXPECT_NE(p.policy->describe().find("budget("), std::string::npos) << p.policy->describe();
}

TEST_F(Budget, FractionZeroSavesOnlyCallsThatKeepNoRegionMemory) {
  const BudgetPlan p = plan({.fraction = 0.0});
  EXPECT_EQ(p.budget_bytes, 0);
  EXPECT_EQ(p.saved_bytes, 0);
  bool saved_free_call = false;
  for (const PlannedCall& call : p.calls) {
    if (call.saved) {
      EXPECT_EQ(call.bytes, 0) << call.op.name << " " << call.call_index;
      saved_free_call = true;
    }
  }
  // Transposes of the weights keep only the weights' storage: free.
  EXPECT_TRUE(saved_free_call);
  EXPECT_EQ(p.with_budget({.bytes = 0}).chosen.size(), p.chosen.size());
}

TEST_F(Budget, LargeBudgetSavesEverySaveableCall) {
  const BudgetPlan p = plan({.fraction = 1e6});
  EXPECT_TRUE(p.optimal);
  EXPECT_LE(p.saved_bytes, p.total_bytes);
  for (const PlannedCall& call : p.calls) {
    EXPECT_EQ(call.saved, call.saveable) << call.op.name << " " << call.call_index;
  }
  // Every call was timed, so avoided is the cost of the saveable calls.
  double saveable_cost = 0;
  for (const PlannedCall& call : p.calls) {
    saveable_cost += call.saveable ? call.cost : 0;
  }
  EXPECT_NEAR(p.avoided_cost, saveable_cost, 1e-9 * saveable_cost);
}

TEST_F(Budget, RegionUnderThePlanHasBitwiseEqualGradientsAndTheSameKeys) {
  const auto reference = gradients(weights, [&](const at::Tensor& x) {
    return attention_block(weights, x);
  });
  const BudgetPlan half = plan({.fraction = 0.5});
  for (const BudgetPlan& p :
       {half.with_budget({.fraction = 0.0}), half, half.with_budget({.fraction = 1e6})}) {
    SCOPED_TRACE(p.summary());
    // The region asks the plan's policy about exactly the calls profiled,
    // with the same keys.
    std::vector<std::pair<c10::OperatorName, int64_t>> asked;
    std::vector<Policy> decisions;
    const PolicyPtr policy = p.policy;
    auto recording = policies::from_callable([&](const OpCall& call) {
      asked.emplace_back(call.op.operator_name(), call.call_index);
      decisions.push_back(policy->decide(call));
      return decisions.back();
    });
    RegionHandle handle;
    const auto grads = gradients(weights, [&](const at::Tensor& x) {
      SacContext region(recording);
      handle = region.handle();
      return attention_block(weights, x);
    });
    expect_bitwise_equal(reference, grads);
    ASSERT_EQ(asked.size(), p.calls.size());
    for (size_t i = 0; i < asked.size(); ++i) {
      EXPECT_EQ(asked[i].first, p.calls[i].op) << i;
      EXPECT_EQ(asked[i].second, p.calls[i].call_index) << i;
      EXPECT_EQ(decisions[i] == Policy::MustSave, p.calls[i].saved) << i;
    }
    EXPECT_GT(handle.stats().policy_calls, 0);
  }
  // The policy itself, as a user passes it.
  const auto grads = gradients(weights, [&](const at::Tensor& x) {
    return checkpoint(
        [&](const at::Tensor& t) { return attention_block(weights, t); }, x, half.policy);
  });
  expect_bitwise_equal(reference, grads);
}

TEST(BudgetAccounting, ViewsShareTheirBaseStorageAndOutsideStoragesAreFree) {
  const auto x = at::randn({256}).requires_grad_();
  const auto w = at::randn({16, 16}).requires_grad_();
  const BudgetPlan p = policies::budget(
      [&] {
        auto y = x.exp();
        auto z = y.view({16, 16}).sin();
        return at::mm(z, w.t());
      },
      {.fraction = 1e6});
  const int64_t n = 256 * 4; // bytes of one float tensor of 256 elements
  const PlannedCall* exp = find_call(p, "aten::exp");
  const PlannedCall* view = find_call(p, "aten::view");
  const PlannedCall* t = find_call(p, "aten::t");
  const PlannedCall* mm = find_call(p, "aten::mm");
  ASSERT_TRUE(exp && view && t && mm);
  EXPECT_EQ(exp->bytes, n);
  EXPECT_EQ(exp->new_bytes, n);
  EXPECT_EQ(view->bytes, n) << "a view keeps its base's storage";
  EXPECT_EQ(view->new_bytes, 0);
  EXPECT_EQ(t->bytes, 0) << "the weight is from outside the region";
  // exp, its view, sin and mm saved: the shared storage counted once.
  EXPECT_EQ(p.total_bytes, 3 * n);
  EXPECT_EQ(p.saved_bytes, 3 * n);
  // exp saves its output, sin and mm their inputs (the view's storage is
  // exp's): autograd keeps the exp and sin outputs.
  EXPECT_EQ(p.activation_bytes, 2 * n);
}

TEST(BudgetAccounting, FlopsCountMatrixMultipliesAndConvolutionsOnly) {
  const auto a = at::randn({8, 16}).requires_grad_();
  const auto b = at::randn({16, 4}).requires_grad_();
  const auto bias = at::randn({16}).requires_grad_();
  const BudgetPlan p = policies::budget(
      [&] { return at::addmm(bias, at::mm(a, b).relu(), b.t()); },
      {.bytes = 1 << 20, .cost = Cost::Flops});
  EXPECT_EQ(p.cost, Cost::Flops);
  const PlannedCall* mm = find_call(p, "aten::mm");
  const PlannedCall* addmm = find_call(p, "aten::addmm");
  const PlannedCall* relu = find_call(p, "aten::relu");
  ASSERT_TRUE(mm && addmm && relu);
  EXPECT_EQ(mm->cost, 2.0 * 8 * 4 * 16);
  EXPECT_EQ(addmm->cost, 2.0 * 8 * 16 * 4);
  EXPECT_EQ(relu->cost, 0);
  EXPECT_TRUE(mm->saved);
  EXPECT_FALSE(relu->saved) << "worth nothing";
  EXPECT_NE(p.summary().find("FLOP"), std::string::npos) << p.summary();

  // flop_counter's conv_flop_count: 2 * batch * c_out * c_in * kernel * output positions.
  const auto image = at::randn({2, 3, 8, 8}).requires_grad_();
  const auto filters = at::randn({4, 3, 3, 3}).requires_grad_();
  const BudgetPlan conv = policies::budget(
      [&] { return at::conv2d(image, filters); }, {.bytes = 1 << 20, .cost = Cost::Flops});
  const PlannedCall* convolution = find_call(conv, "aten::convolution");
  ASSERT_NE(convolution, nullptr);
  EXPECT_EQ(convolution->cost, 2.0 * 2 * 4 * 3 * 3 * 3 * 6 * 6);
}

TEST_F(Budget, BadOptionsRaiseValueErrorWithoutRunningFn) {
  bool ran = false;
  auto fn = [&] { ran = true; };
  auto expect_error = [&](const BudgetOptions& options, const std::string& message) {
    try {
      policies::budget(fn, options);
      ADD_FAILURE() << "no error; expected: " << message;
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("torch_sac::policies::budget"), std::string::npos);
    }
  };
  expect_error(
      {}, "pass exactly one of BudgetOptions::bytes and BudgetOptions::fraction (got neither)");
  expect_error({.bytes = 1, .fraction = 0.5}, "(got both)");
  expect_error({.bytes = -1}, "BudgetOptions::bytes must be >= 0");
  expect_error({.fraction = -0.5}, "BudgetOptions::fraction must be finite and >= 0");
  expect_error({.fraction = std::nan("")}, "BudgetOptions::fraction must be finite and >= 0");
  expect_error({.fraction = 0.5, .repeats = -1}, "BudgetOptions::repeats");
  expect_error({.fraction = 0.5, .max_states = 0}, "BudgetOptions::max_states");
  EXPECT_FALSE(ran);
  EXPECT_THROW(policies::budget(nullptr, {.fraction = 0.5}), c10::ValueError);
  const BudgetPlan p = plan({.fraction = 0.5});
  EXPECT_THROW(p.with_budget({.bytes = -3}), c10::ValueError);
  EXPECT_THROW(BudgetPlan().with_budget({.bytes = 3}), c10::ValueError);
}

TEST_F(Budget, NothingStaysInstalledAndTheRandomStateIsRestored) {
  at::manual_seed(5);
  const at::Tensor expected = at::rand({8});
  {
    at::NoGradGuard no_grad; // the profile runs with grad on, then it is off again
    at::manual_seed(5);
    bool grad_inside = false;
    plan({.fraction = 0.5});
    policies::budget([&] { grad_inside = c10::GradMode::is_enabled(); }, {.bytes = 0});
    EXPECT_TRUE(grad_inside);
    EXPECT_FALSE(c10::GradMode::is_enabled());
    EXPECT_TRUE(at::equal(at::rand({8}), expected)) << "dropout in the profile drew from a fork";
  }
  expect_nothing_installed();

  at::manual_seed(5);
  try {
    policies::budget(
        [&] {
          (void)at::dropout(example, 0.5, /*train=*/true);
          throw std::runtime_error("the region failed");
        },
        {.fraction = 0.5});
    ADD_FAILURE() << "fn's exception must propagate";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the region failed");
  }
  expect_nothing_installed();
  EXPECT_TRUE(at::equal(at::rand({8}), expected));
}

TEST_F(Budget, RefusedInsideARegion) {
  SacContext region(policies::recompute_all());
  try {
    plan({.fraction = 0.5});
    ADD_FAILURE() << "budget inside a SacContext must raise";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("called inside a SacContext"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(key_handler_depth(), 1u) << "the region's handler, nothing else";
}

TEST(BudgetProfile, GraphOfTheProfiledRunStaysUsableAndVersionChecked) {
  const auto x = at::randn({16}).requires_grad_();
  at::Tensor out;
  policies::budget([&] { out = x.exp(); }, {.fraction = 0.5});
  out.sum().backward({}, /*retain_graph=*/true);
  EXPECT_TRUE(at::equal(x.grad(), x.exp()));
  {
    at::NoGradGuard no_grad;
    out.add_(1); // exp saved its output for backward
  }
  try {
    out.sum().backward();
    ADD_FAILURE() << "backward through a modified saved tensor must raise";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation"), std::string::npos)
        << e.what();
  }
}

} // namespace
} // namespace torch_sac
