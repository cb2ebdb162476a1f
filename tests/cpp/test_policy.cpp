// Policy combination and conversion, ignored ops, and the built-in policies'
// decisions, without running any op.

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include "csrc/core/ignored_ops.h"
#include "csrc/core/policy.h"
#include "policies/builtin_policies.h"

namespace torch_sac {
namespace {

constexpr Policy kAll[] = {Policy::MustSave,        Policy::PreferSave,  Policy::MustRecompute,
                           Policy::PreferRecompute, Policy::MustOffload, Policy::PreferOffload};

TEST(Policy, ValuesMatchTorchCheckpointPolicy) {
  EXPECT_EQ(static_cast<int>(Policy::MustSave), 0);
  EXPECT_EQ(static_cast<int>(Policy::PreferSave), 1);
  EXPECT_EQ(static_cast<int>(Policy::MustRecompute), 2);
  EXPECT_EQ(static_cast<int>(Policy::PreferRecompute), 3);
  EXPECT_EQ(static_cast<int>(Policy::MustOffload), 4);   // MUST_CPU_OFFLOAD
  EXPECT_EQ(static_cast<int>(Policy::PreferOffload), 5); // PREFER_CPU_OFFLOAD
}

TEST(Policy, BoolConversionFollowsTorch) {
  EXPECT_EQ(policy_from_bool(true), Policy::MustSave);
  EXPECT_EQ(policy_from_bool(false), Policy::PreferRecompute);
}

TEST(Policy, Predicates) {
  EXPECT_TRUE(is_save(Policy::MustSave));
  EXPECT_TRUE(is_save(Policy::PreferSave));
  EXPECT_FALSE(is_save(Policy::MustRecompute));
  EXPECT_FALSE(is_save(Policy::PreferRecompute));
  EXPECT_TRUE(is_must(Policy::MustSave));
  EXPECT_TRUE(is_must(Policy::MustRecompute));
  EXPECT_FALSE(is_must(Policy::PreferSave));
  EXPECT_EQ(policy_name(Policy::PreferRecompute), "PREFER_RECOMPUTE");
  EXPECT_TRUE(is_offload(Policy::MustOffload));
  EXPECT_TRUE(is_offload(Policy::PreferOffload));
  EXPECT_FALSE(is_save(Policy::PreferOffload));
  EXPECT_TRUE(is_kept(Policy::PreferOffload));
  EXPECT_TRUE(is_kept(Policy::MustSave));
  EXPECT_FALSE(is_kept(Policy::PreferRecompute));
  EXPECT_TRUE(is_must(Policy::MustOffload));
  EXPECT_FALSE(is_must(Policy::PreferOffload));
  EXPECT_EQ(policy_name(Policy::MustOffload), "MUST_OFFLOAD");
}

TEST(Policy, MustBeatsPrefer) {
  EXPECT_EQ(combine_policies(Policy::MustSave, Policy::PreferRecompute, "op"), Policy::MustSave);
  EXPECT_EQ(
      combine_policies(Policy::PreferSave, Policy::MustRecompute, "op"), Policy::MustRecompute);
  EXPECT_EQ(
      combine_policies(Policy::MustRecompute, Policy::PreferSave, "op"), Policy::MustRecompute);
}

TEST(Policy, InnermostPreferWins) {
  EXPECT_EQ(
      combine_policies(Policy::PreferSave, Policy::PreferRecompute, "op"), Policy::PreferRecompute);
  EXPECT_EQ(
      combine_policies(Policy::PreferRecompute, Policy::PreferSave, "op"), Policy::PreferSave);
}

TEST(Policy, EqualMustsAgree) {
  for (Policy p : {Policy::MustSave, Policy::MustRecompute, Policy::MustOffload}) {
    EXPECT_EQ(combine_policies(p, p, "op"), p);
  }
}

TEST(Policy, ConflictingMustsRaiseNamingTheOp) {
  try {
    combine_policies(Policy::MustSave, Policy::MustRecompute, "aten::mm.default");
    FAIL() << "expected a conflict error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("aten::mm.default"), std::string::npos) << msg;
    EXPECT_NE(msg.find("MUST_SAVE"), std::string::npos) << msg;
    EXPECT_NE(msg.find("MUST_RECOMPUTE"), std::string::npos) << msg;
  }
}

TEST(Policy, CombinationIsTotalOverAllPairs) {
  for (Policy outer : kAll) {
    for (Policy inner : kAll) {
      if (is_must(outer) && is_must(inner) && outer != inner) {
        EXPECT_THROW(combine_policies(outer, inner, "op"), c10::Error);
        continue;
      }
      const Policy got = combine_policies(outer, inner, "op");
      EXPECT_EQ(got, is_must(outer) && !is_must(inner) ? outer : inner);
    }
  }
}

TEST(IgnoredOps, CoverTorchSacIgnoredOps) {
  EXPECT_TRUE(is_ignored_op({"aten::detach", ""}));
  EXPECT_TRUE(is_ignored_op({"prim::device", ""}));
  EXPECT_TRUE(is_ignored_op({"aten::is_contiguous", "memory_format"}));
  EXPECT_TRUE(is_ignored_op({"aten::sym_size", ""}));
  EXPECT_FALSE(is_ignored_op({"aten::mm", ""}));
  EXPECT_FALSE(is_ignored_op({"aten::detach_", ""}));
  EXPECT_FALSE(is_ignored_op({"aten::size", "int"}));
  EXPECT_EQ(ignored_op_names().size(), 15u);
}

// A decision needs an OpCall, which needs a registered operator.
Policy decide(OpPolicy& policy, const char* name, const char* overload, int64_t call_index = 0) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  return policy.decide(OpCall{op, {}, {}, call_index});
}

TEST(BuiltinPolicies, SaveOpsMatchesOverloadsAndPackets) {
  auto policy = policies::save_ops({{"aten::mm", ""}, {"aten::add", std::nullopt}});
  EXPECT_EQ(decide(*policy, "aten::mm", ""), Policy::MustSave);
  EXPECT_EQ(decide(*policy, "aten::mm", "out"), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::add", "Tensor"), Policy::MustSave);
  EXPECT_EQ(decide(*policy, "aten::add", "Scalar"), Policy::MustSave);
  EXPECT_EQ(decide(*policy, "aten::mul", "Tensor"), Policy::PreferRecompute);
}

TEST(BuiltinPolicies, SaveOpsRejectsUnqualifiedNames) {
  EXPECT_THROW(policies::save_ops({{"mm", ""}}), c10::ValueError);
}

TEST(BuiltinPolicies, ConstantPolicies) {
  EXPECT_EQ(decide(*policies::save_all(), "aten::relu", ""), Policy::PreferSave);
  EXPECT_EQ(decide(*policies::recompute_all(), "aten::mm", ""), Policy::PreferRecompute);
}

TEST(BuiltinPolicies, SaveMatmulsCoversMatmulsConvolutionsAndAttention) {
  auto policy = policies::save_matmuls();
  for (auto [name, overload] : std::vector<std::pair<const char*, const char*>>{
           {"aten::mm", ""},
           {"aten::addmm", ""},
           {"aten::bmm", ""},
           {"aten::baddbmm", ""},
           {"aten::convolution", ""},
           {"aten::_scaled_dot_product_flash_attention_for_cpu", ""}}) {
    EXPECT_EQ(decide(*policy, name, overload), Policy::MustSave) << name;
  }
  EXPECT_EQ(decide(*policy, "aten::gelu", ""), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::_softmax", ""), Policy::PreferRecompute);
}

TEST(BuiltinPolicies, EveryNthUsesTheCallIndex) {
  auto policy = policies::every_nth({{"aten::mm", std::nullopt}}, 3);
  for (int64_t i = 0; i < 9; ++i) {
    EXPECT_EQ(
        decide(*policy, "aten::mm", "", i), i % 3 == 0 ? Policy::MustSave : Policy::PreferRecompute)
        << "call " << i;
  }
  EXPECT_EQ(decide(*policy, "aten::addmm", "", 0), Policy::PreferRecompute);
  // Same index, same answer: no hidden state.
  EXPECT_EQ(decide(*policy, "aten::mm", "", 1), decide(*policy, "aten::mm", "", 1));
  EXPECT_THROW(policies::every_nth({{"aten::mm", std::nullopt}}, 0), c10::ValueError);
}

} // namespace
} // namespace torch_sac
