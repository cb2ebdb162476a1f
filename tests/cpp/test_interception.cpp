// The dispatch-key adapter and the selective cache, driven from pure C++:
// ops run with the interceptor on, outputs and gradients checked.

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <map>

#include "csrc/core/interceptor.h"
#include "csrc/core/selective_cache.h"
#include "policies/builtin_policies.h"
#include "tests/cpp/key_adapter_test.h"

namespace torch_sac {
namespace {

std::string full_name(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.name + (n.overload_name.empty() ? "" : "." + n.overload_name);
}

// Passes every op through and remembers its name.
class RecordingHandler final : public OpHandler {
 public:
  void handle(const c10::OperatorHandle& op, torch::jit::Stack* stack, RunOp run, const void*)
      override {
    seen.push_back(full_name(op));
    run(stack);
  }
  std::vector<std::string> seen;
};

class ThrowingPolicy final : public OpPolicy {
 public:
  Policy decide(const OpCall& call) override {
    TORCH_CHECK(false, "policy failed on ", full_name(call.op));
  }
  std::string describe() const override {
    return "throwing";
  }
};

using KeyAdapter = KeyAdapterTest;

size_t count(const std::vector<std::string>& v, const std::string& s) {
  return std::count(v.begin(), v.end(), s);
}

TEST_F(KeyAdapter, SeesEachOpOnceBelowAutograd) {
  auto recorder = std::make_shared<RecordingHandler>();
  auto a = at::randn({4, 4}).requires_grad_();
  auto b = at::randn({4, 4});
  {
    KeyAdapterScope scope(recorder);
    auto c = at::mm(a, b).relu();
    (void)c;
  }
  // mm's CPU kernel allocates its output with at::empty: nested ops are not
  // seen, and each op is seen once.
  EXPECT_EQ(count(recorder->seen, "aten::mm"), 1u);
  EXPECT_EQ(count(recorder->seen, "aten::relu"), 1u);
  EXPECT_EQ(count(recorder->seen, "aten::empty.memory_format"), 0u);
  EXPECT_EQ(key_handler_depth(), 0u);
  const size_t before = recorder->seen.size();
  auto d = at::mm(a, b);
  EXPECT_EQ(recorder->seen.size(), before) << "interception must stop with the scope";
}

TEST_F(KeyAdapter, SeesDecomposedOpsLikeATorchDispatchMode) {
  auto recorder = std::make_shared<RecordingHandler>();
  auto x = at::randn({2, 3}).requires_grad_();
  auto w = at::randn({5, 3}).requires_grad_();
  auto bias = at::randn({5}).requires_grad_();
  {
    KeyAdapterScope scope(recorder);
    auto y = at::linear(x, w, bias);
    (void)y;
  }
  // linear is CompositeImplicitAutograd: it decomposes above autograd into
  // t + addmm, which is what a TorchDispatchMode sees too.
  EXPECT_EQ(count(recorder->seen, "aten::addmm"), 1u);
  EXPECT_EQ(count(recorder->seen, "aten::t"), 1u);
  EXPECT_EQ(count(recorder->seen, "aten::linear"), 0u);
}

TEST_F(KeyAdapter, NestedHandlersEachSeeEveryOp) {
  auto outer = std::make_shared<RecordingHandler>();
  auto inner = std::make_shared<RecordingHandler>();
  auto a = at::randn({3, 3});
  {
    KeyAdapterScope outer_scope(outer);
    KeyAdapterScope inner_scope(inner);
    auto b = at::sin(a);
    (void)b;
    EXPECT_EQ(key_handler_depth(), 2u);
  }
  EXPECT_EQ(outer->seen, inner->seen);
  EXPECT_EQ(count(inner->seen, "aten::sin"), 1u);
}

TEST_F(KeyAdapter, PopOutOfOrderRaisesAndStillRemovesTheHandler) {
  auto first = std::make_shared<RecordingHandler>();
  auto second = std::make_shared<RecordingHandler>();
  push_key_handler(first);
  push_key_handler(second);
  EXPECT_THROW(pop_key_handler(first.get()), c10::Error);
  EXPECT_EQ(key_handler_depth(), 1u);
  EXPECT_THROW(pop_key_handler(first.get()), c10::Error); // no longer there
  pop_key_handler(second.get());
  EXPECT_EQ(key_handler_depth(), 0u);
  EXPECT_FALSE(c10::impl::tls_is_dispatch_key_included(kInterceptKey));
}

// A small MLP, forward and backward, returning the loss and the gradients.
std::vector<at::Tensor> mlp_step(const std::vector<at::Tensor>& params, const at::Tensor& x) {
  for (const auto& p : params) {
    p.mutable_grad() = at::Tensor();
  }
  auto h = at::linear(x, params[0], params[1]).tanh();
  h = at::linear(h, params[2], params[3]).relu();
  auto loss = (h * h).sum();
  loss.backward();
  std::vector<at::Tensor> out = {loss.detach()};
  for (const auto& p : params) {
    out.push_back(p.grad().clone());
  }
  return out;
}

TEST_F(KeyAdapter, OutputsAndGradientsUnchangedUnderCaching) {
  at::manual_seed(0);
  std::vector<at::Tensor> params = {
      at::randn({8, 4}).requires_grad_(), at::randn({8}).requires_grad_(),
      at::randn({3, 8}).requires_grad_(), at::randn({3}).requires_grad_()};
  auto x = at::randn({5, 4});
  const auto expected = mlp_step(params, x);
  for (auto policy : {policies::save_all(), policies::recompute_all(), policies::save_matmuls()}) {
    auto sac = make_selective_checkpoint(policy, false);
    std::vector<at::Tensor> got;
    {
      KeyAdapterScope scope(sac.caching);
      got = mlp_step(params, x);
    }
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i], expected[i])) << policy->describe() << " output " << i;
    }
    EXPECT_GT(sac.cache->stats().policy_calls, 0) << policy->describe();
  }
}

TEST_F(KeyAdapter, PolicyErrorPropagatesAndScopeEnds) {
  auto sac = make_selective_checkpoint(std::make_shared<ThrowingPolicy>(), false);
  auto a = at::randn({2, 2}).requires_grad_();
  try {
    KeyAdapterScope scope(sac.caching);
    auto b = at::exp(a);
    FAIL() << "policy error was swallowed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("aten::exp"), std::string::npos);
  }
  EXPECT_EQ(key_handler_depth(), 0u);
  EXPECT_FALSE(c10::impl::tls_is_dispatch_key_included(kInterceptKey));
}

class SelectiveCacheTest : public KeyAdapter {
 protected:
  // Forward: y = relu(a @ b) under the caching handler with `policy`.
  at::Tensor forward(SelectiveCheckpoint& sac, const at::Tensor& a, const at::Tensor& b) {
    sac.cache->begin_forward();
    at::Tensor out;
    {
      KeyAdapterScope scope(sac.caching);
      mm_out = at::mm(a, b);
      out = mm_out.relu();
    }
    sac.cache->finish_forward();
    return out;
  }
  // Recompute: the same ops under the cached handler.
  std::pair<at::Tensor, at::Tensor> recompute(
      SelectiveCheckpoint& sac,
      const at::Tensor& a,
      const at::Tensor& b) {
    sac.cache->begin_recompute();
    KeyAdapterScope scope(sac.cached);
    auto m = at::mm(a, b);
    return {m, m.relu()};
  }
  at::Tensor mm_out;
};

TEST_F(SelectiveCacheTest, RecomputeReturnsCachedOutputsAndRerunsTheRest) {
  auto sac = make_selective_checkpoint(policies::save_ops({{"aten::mm", std::nullopt}}), false);
  auto a = at::randn({3, 3}).requires_grad_();
  auto b = at::randn({3, 3});
  auto y = forward(sac, a, b);
  EXPECT_EQ(sac.cache->stats().saved_ops, 1);
  EXPECT_EQ(sac.cache->stats().saved_bytes, 9 * 4);
  auto [m, r] = recompute(sac, a, b);
  // The cached mm output shares storage with forward's; relu ran again.
  EXPECT_EQ(m.data_ptr(), mm_out.data_ptr());
  EXPECT_NE(r.data_ptr(), y.data_ptr());
  EXPECT_TRUE(at::equal(r, y));
  EXPECT_EQ(sac.cache->stats().cache_hits, 1);
  EXPECT_EQ(sac.cache->stats().replayed_ops, 1);
}

TEST_F(SelectiveCacheTest, SummaryCountsNewTensorsAndRecomputesPerCall) {
  auto sac = make_selective_checkpoint(policies::save_ops({{"aten::mm", std::nullopt}}), false);
  auto a = at::randn({3, 3}).requires_grad_();
  auto b = at::randn({3, 3});
  sac.cache->begin_forward();
  {
    KeyAdapterScope scope(sac.caching);
    at::sin(a).t().relu_(); // a view and an in-place op make no new tensor
  }
  forward(sac, a, b);
  recompute(sac, a, b);
  std::map<std::string, OpSummary> rows;
  for (auto& s : sac.cache->summary()) {
    rows.emplace(s.op, std::move(s));
  }
  const OpSummary& mm = rows.at("aten::mm.default");
  EXPECT_EQ(mm.saved_new, 1);
  EXPECT_EQ(mm.saved_bytes, 9 * 4);
  EXPECT_EQ(mm.recomputes_by_call, (std::vector<int64_t>{0}));
  EXPECT_EQ(rows.at("aten::sin.default").dropped_bytes, 9 * 4);
  for (const char* op : {"aten::t.default", "aten::relu_.default"}) {
    EXPECT_EQ(rows.at(op).dropped, 1) << op; // every call counts in op_summary
    EXPECT_EQ(rows.at(op).dropped_new + rows.at(op).saved_new, 0) << op;
    EXPECT_EQ(rows.at(op).dropped_bytes, 0) << op;
  }
  // Recompute met relu (the first call was relu_): one re-run, of call 0.
  const OpSummary& relu = rows.at("aten::relu.default");
  EXPECT_EQ(relu.dropped_new, 1);
  EXPECT_EQ(relu.dropped_bytes, 9 * 4);
  EXPECT_EQ(relu.recomputed, 1);
  EXPECT_EQ(relu.recomputes_by_call, (std::vector<int64_t>{1}));
  int64_t recompute_ns = 0;
  for (const auto& [op, s] : rows) {
    recompute_ns += s.recompute_ns;
  }
  EXPECT_EQ(sac.cache->stats().replay_ns, recompute_ns);
}

TEST_F(SelectiveCacheTest, SecondRecomputeRaisesLikeTorch) {
  auto sac = make_selective_checkpoint(policies::save_ops({{"aten::mm", std::nullopt}}), false);
  auto a = at::randn({3, 3}).requires_grad_();
  auto b = at::randn({3, 3});
  forward(sac, a, b);
  recompute(sac, a, b);
  try {
    recompute(sac, a, b);
    FAIL() << "second recompute did not raise";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("Trying to backward an extra time"), std::string::npos) << msg;
    EXPECT_NE(msg.find("aten::mm"), std::string::npos) << msg;
  }
}

TEST_F(SelectiveCacheTest, MutatedCacheEntryRaisesNamingTheOp) {
  auto sac = make_selective_checkpoint(policies::save_ops({{"aten::mm", std::nullopt}}), false);
  auto a = at::randn({3, 3}).requires_grad_();
  auto b = at::randn({3, 3});
  forward(sac, a, b);
  {
    c10::NoGradGuard no_grad;
    mm_out.add_(1);
  }
  try {
    recompute(sac, a, b);
    FAIL() << "mutation was not detected";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("aten::mm.default"), std::string::npos) << msg;
    EXPECT_NE(msg.find("allow_cache_entry_mutation"), std::string::npos) << msg;
  }
}

TEST_F(SelectiveCacheTest, MutationAllowedWhenAsked) {
  auto sac = make_selective_checkpoint(policies::save_ops({{"aten::mm", std::nullopt}}), true);
  auto a = at::randn({3, 3}).requires_grad_();
  auto b = at::randn({3, 3});
  forward(sac, a, b);
  {
    c10::NoGradGuard no_grad;
    mm_out.add_(1);
  }
  auto [m, r] = recompute(sac, a, b);
  EXPECT_TRUE(at::equal(m, mm_out));
}

TEST_F(SelectiveCacheTest, OpMissingFromForwardRaises) {
  auto sac = make_selective_checkpoint(policies::save_all(), false);
  auto a = at::randn({3, 3}).requires_grad_();
  auto b = at::randn({3, 3});
  forward(sac, a, b);
  sac.cache->begin_recompute();
  KeyAdapterScope scope(sac.cached);
  EXPECT_THROW(at::sin(a), c10::Error);
}

TEST_F(SelectiveCacheTest, NothingRecordedWithGradDisabled) {
  auto sac = make_selective_checkpoint(policies::save_all(), false);
  auto a = at::randn({3, 3}).requires_grad_();
  auto b = at::randn({3, 3});
  {
    c10::NoGradGuard no_grad;
    forward(sac, a, b);
  }
  {
    c10::InferenceMode inference;
    forward(sac, a, b);
  }
  EXPECT_EQ(sac.cache->stats().policy_calls, 0);
  EXPECT_EQ(sac.cache->stats().saved_ops, 0);
}

} // namespace
} // namespace torch_sac
