// Facts about ops (csrc/core/op_facts.h): what they say for a handful of ops,
// and that the drop-in and the region engine read the same facts and apply
// the same rule to random calls.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <set>
#include <string>

#include "csrc/core/interceptor.h"
#include "csrc/core/op_facts.h"
#include "csrc/core/region/region.h"
#include "csrc/core/selective_cache.h"
#include "policies/builtin_policies.h"
#include "tests/cpp/key_adapter_test.h"

namespace torch_sac {
namespace region {

// Friend of Region: what it recorded, by op name.
struct RegionTestAccess {
  static const OpFacts* facts(const Region& region, const std::string& name) {
    for (const auto& info : region.tape_.ops) {
      if (info.facts->name == name) {
        return info.facts.get();
      }
    }
    return nullptr;
  }
  // Whether the entries of `name` hold an RNG snapshot, in call order.
  static std::vector<bool> rng_snapshots(const Region& region, const std::string& name) {
    std::vector<bool> out;
    for (const auto& entry : region.tape_.entries) {
      if (region.tape_.ops[entry.op_index].facts->name == name) {
        out.push_back(entry.rng.has_value());
      }
    }
    return out;
  }
};

} // namespace region

namespace {

c10::OperatorHandle op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

TEST(OpFacts, C10dCollectivesThatFillABuffer) {
  const auto found = c10::Dispatcher::singleton().findSchema({"c10d::_allgather_base_", ""});
  if (!found) {
    GTEST_SKIP() << "torch built without torch.distributed";
  }
  // The buffer (argument 0) is the one write; the tensor returned is it.
  const auto facts = op_facts(*found);
  EXPECT_TRUE(facts->collective);
  EXPECT_TRUE(facts->replayable_collective);
  ASSERT_TRUE(facts->filled_buffer.has_value());
  EXPECT_EQ(*facts->filled_buffer, 0u);
  EXPECT_EQ(facts->written_args, std::vector<size_t>{0});
  EXPECT_TRUE(facts->returns_alias);
  EXPECT_TRUE(facts->returns_written_arg);
  EXPECT_FALSE(facts->makes_new_tensors);
  for (const char* name : {"c10d::_reduce_scatter_base_", "c10d::alltoall_base_"}) {
    const auto other = op_facts(op(name, ""));
    EXPECT_TRUE(other->replayable_collective) << name;
    EXPECT_EQ(other->written_args, std::vector<size_t>{0}) << name;
  }
  // all_reduce reads what it writes: not replayed, every tensor written.
  const auto all_reduce = op_facts(op("c10d::allreduce_", ""));
  EXPECT_FALSE(all_reduce->replayable_collective);
  EXPECT_FALSE(all_reduce->filled_buffer.has_value());
  EXPECT_FALSE(all_reduce->written_args.empty());
}

TEST(OpFacts, SchemaFactsOfCommonOps) {
  const auto mm = op_facts(op("aten::mm", ""));
  EXPECT_EQ(mm->name, "aten::mm.default");
  EXPECT_FALSE(mm->ignored);
  EXPECT_TRUE(mm->written_args.empty());
  EXPECT_TRUE(mm->makes_new_tensors);
  EXPECT_FALSE(mm->returns_alias);
  EXPECT_FALSE(mm->draws_random);
  EXPECT_EQ(mm->num_args, 2u);
  EXPECT_EQ(mm->num_returns, 1u);

  const auto add_ = op_facts(op("aten::add_", "Tensor"));
  EXPECT_EQ(add_->written_args, (std::vector<size_t>{0}));
  EXPECT_TRUE(add_->returns_written_arg);
  EXPECT_TRUE(add_->returns_alias);
  EXPECT_FALSE(add_->makes_new_tensors);

  const auto mm_out = op_facts(op("aten::mm", "out"));
  EXPECT_EQ(mm_out->written_args, (std::vector<size_t>{2}));
  EXPECT_TRUE(mm_out->returns_written_arg);
  EXPECT_FALSE(mm_out->makes_new_tensors);

  const auto view = op_facts(op("aten::view", ""));
  EXPECT_TRUE(view->written_args.empty());
  EXPECT_TRUE(view->returns_alias);
  EXPECT_FALSE(view->returns_written_arg);
  EXPECT_FALSE(view->makes_new_tensors);

  const auto bernoulli_ = op_facts(op("aten::bernoulli_", "float"));
  EXPECT_TRUE(bernoulli_->draws_random);
  EXPECT_FALSE(bernoulli_->dropout_p_arg.has_value());
  const auto dropout = op_facts(op("aten::native_dropout", ""));
  EXPECT_TRUE(dropout->draws_random);
  EXPECT_TRUE(dropout->makes_new_tensors);

  const auto sdpa = op_facts(op("aten::_scaled_dot_product_flash_attention_for_cpu", ""));
  EXPECT_TRUE(sdpa->draws_random);
  ASSERT_TRUE(sdpa->dropout_p_arg.has_value());
  EXPECT_EQ(sdpa->dropout_p_arg, std::optional<size_t>(3));

  EXPECT_TRUE(op_facts(op("aten::detach", ""))->ignored);
  // Cached: the same object every time.
  EXPECT_EQ(op_facts(op("aten::mm", "")).get(), mm.get());
}

TEST(OpFacts, CallDrawsRandomUnlessDropoutIsZero) {
  const auto sdpa = op_facts(op("aten::_scaled_dot_product_flash_attention_for_cpu", ""));
  const auto q = at::randn({1, 1, 2, 4});
  std::vector<c10::IValue> args{q, q, q, 0.0, false};
  args.resize(sdpa->num_args);
  EXPECT_FALSE(call_draws_random(*sdpa, args));
  args[3] = 0.1;
  EXPECT_TRUE(call_draws_random(*sdpa, args));
  const auto bernoulli_ = op_facts(op("aten::bernoulli_", "float"));
  EXPECT_TRUE(call_draws_random(*bernoulli_, {q, 0.0, c10::IValue()}));
  const auto mm = op_facts(op("aten::mm", ""));
  EXPECT_FALSE(call_draws_random(*mm, {q, q}));
}

class OpFactsEngines : public KeyAdapterTest {
 protected:
  // mm, add_, a view, mm.out, dropout and attention without and with dropout.
  static void run_ops(const at::Tensor& x) {
    auto m = at::mm(x, x);
    m.add_(x);
    auto v = m.view({-1});
    // out= ops take no tensors that require grad.
    const auto c = at::randn({4, 4});
    auto out = at::empty_like(c);
    at::mm_out(out, c, c);
    auto d = at::dropout(m, 0.5, /*train=*/true);
    const auto q = (d + v.view({4, 4})).view({1, 1, 4, 4});
    auto a0 = at::scaled_dot_product_attention(q, q, q, std::nullopt, 0.0);
    auto a1 = at::scaled_dot_product_attention(q, q, q, std::nullopt, 0.5);
  }
};

TEST_F(OpFactsEngines, BothEnginesReadTheSameFactsAndRandomRule) {
  const auto x = at::randn({4, 4}).requires_grad_();

  auto region = std::make_shared<region::Region>(policies::save_all(), false);
  {
    KeyAdapterScope scope(region);
    run_ops(x);
  }
  region->close();

  auto sac = make_selective_checkpoint(policies::save_all(), false);
  sac.cache->begin_forward();
  {
    KeyAdapterScope scope(sac.caching);
    run_ops(x);
  }
  sac.cache->finish_forward();

  const char* ops[][2] = {
      {"aten::mm", ""},
      {"aten::add_", "Tensor"},
      {"aten::view", ""},
      {"aten::mm", "out"},
      {"aten::bernoulli_", "float"},
      {"aten::_scaled_dot_product_flash_attention_for_cpu", ""},
  };
  for (const auto& [name, overload] : ops) {
    const c10::OperatorHandle handle = op(name, overload);
    const auto facts = op_facts(handle);
    const OpFacts* in_region = region::RegionTestAccess::facts(*region, facts->name);
    ASSERT_NE(in_region, nullptr) << facts->name;
    EXPECT_EQ(in_region, facts.get()) << facts->name;
    EXPECT_EQ(sac.cache->record_for(handle).facts.get(), facts.get()) << facts->name;
  }

  // Attention without dropout draws nothing: the drop-in caches it under
  // save_all. bernoulli_ (the dropout of SDPA's math path and of
  // at::dropout) draws: never cached.
  std::set<std::string> cached;
  for (const auto& [handle, call] : sac.cache->saved_calls()) {
    cached.insert(op_facts(handle)->name);
  }
  EXPECT_TRUE(cached.count("aten::_scaled_dot_product_flash_attention_for_cpu.default"));
  EXPECT_FALSE(cached.count("aten::bernoulli_.float"));
}

TEST_F(OpFactsEngines, RegionSnapshotsOnlyCallsThatDraw) {
  // Everything dropped: each op is replayable, so the region snapshots
  // exactly the calls that draw.
  const auto x = at::randn({4, 4}).requires_grad_();
  auto region = std::make_shared<region::Region>(policies::recompute_all(), false);
  {
    KeyAdapterScope scope(region);
    const auto q = x.exp().view({1, 1, 4, 4});
    auto a0 = at::scaled_dot_product_attention(q, q, q, std::nullopt, 0.0);
    auto a1 = at::_scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0);
    auto d = at::dropout(q, 0.5, /*train=*/true);
  }
  // Read before close(), which frees the tape of a region nothing refers to.
  EXPECT_EQ(
      region::RegionTestAccess::rng_snapshots(
          *region, "aten::_scaled_dot_product_flash_attention_for_cpu.default"),
      (std::vector<bool>{false, false}));
  const auto bernoulli = region::RegionTestAccess::rng_snapshots(*region, "aten::bernoulli_.float");
  const auto native = region::RegionTestAccess::rng_snapshots(
      *region, "aten::native_dropout.default");
  EXPECT_EQ(bernoulli.size() + native.size(), 1u);
  for (bool snap : bernoulli) {
    EXPECT_TRUE(snap);
  }
  for (bool snap : native) {
    EXPECT_TRUE(snap);
  }
  region->close();
}

} // namespace
} // namespace torch_sac
