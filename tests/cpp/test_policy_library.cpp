// Named scopes (the thread-local name stack) and save_by_name's decisions,
// without running any op.

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <thread>
#include <vector>

#include "csrc/core/name_scope.h"
#include "policies/builtin_policies.h"

namespace torch_sac {
namespace {

std::vector<std::string> open_names() {
  std::vector<std::string> out;
  for (const NameId id : active_names()) {
    out.push_back(name_string(id));
  }
  return out;
}

using Names = std::vector<std::string>;

TEST(NameScope, InterningIsStable) {
  const NameId a = intern_name("attn_out");
  EXPECT_EQ(intern_name("attn_out"), a);
  EXPECT_NE(intern_name("mlp_out"), a);
  EXPECT_EQ(name_string(a), "attn_out");
  EXPECT_THROW(intern_name(""), c10::ValueError);
  EXPECT_THROW(name_string(-1), c10::IndexError);
  EXPECT_THROW(name_string(1 << 30), c10::IndexError);
}

TEST(NameScope, RaiiNestsAndUnwinds) {
  ASSERT_TRUE(active_names().empty());
  {
    NameScope outer("block");
    EXPECT_EQ(open_names(), Names({"block"}));
    {
      NameScope inner("attn_out");
      EXPECT_EQ(open_names(), Names({"block", "attn_out"}));
    }
    EXPECT_EQ(open_names(), Names({"block"}));
  }
  EXPECT_TRUE(active_names().empty());
}

TEST(NameScope, ExceptionUnwindsScopes) {
  try {
    NameScope outer("block");
    NameScope inner("attn_out");
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(active_names().empty());
}

TEST(NameScope, SameNameTwiceIsTwoScopes) {
  NameScope a("block");
  {
    NameScope b("block");
    EXPECT_EQ(open_names(), Names({"block", "block"}));
  }
  EXPECT_EQ(open_names(), Names({"block"}));
}

TEST(NameScope, PopOutOfOrderRaisesAndKeepsTheStack) {
  const NameId a = intern_name("a");
  const NameId b = intern_name("b");
  const size_t da = push_name(a);
  const size_t db = push_name(b);
  try {
    pop_name(a, db); // a is not at b's depth
    FAIL() << "expected an out-of-order error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("'a'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
  }
  EXPECT_EQ(open_names(), Names({"a", "b"}));
  pop_name(b, db);
  pop_name(a, da);
  EXPECT_TRUE(active_names().empty());
  EXPECT_THROW(pop_name(a, da), c10::Error); // nothing open any more
}

TEST(NameScope, ClosingAnOuterScopeClosesLeakedInnerOnesAndRaises) {
  const NameId a = intern_name("a");
  const size_t da = push_name(a);
  push_name(intern_name("leaked"));
  try {
    pop_name(a, da);
    FAIL() << "expected an out-of-order error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("'leaked'"), std::string::npos) << msg;
  }
  EXPECT_TRUE(active_names().empty());
}

TEST(NameScope, StackIsPerThread) {
  NameScope here("main_thread_scope");
  std::vector<std::string> seen_there = {"not run"};
  std::thread t([&] {
    seen_there = open_names();
    NameScope there("other_thread_scope");
  });
  t.join();
  EXPECT_TRUE(seen_there.empty());
  EXPECT_EQ(open_names(), Names({"main_thread_scope"}));
}

TEST(NameScope, OverrideReplacesAndRestores) {
  NameScope here("outer");
  {
    NameStackOverride override_({intern_name("x"), intern_name("y")});
    EXPECT_EQ(open_names(), Names({"x", "y"}));
  }
  EXPECT_EQ(open_names(), Names({"outer"}));
}

Policy decide(
    OpPolicy& policy,
    const char* name = "aten::mm",
    int64_t call_index = 0,
    const char* overload = "") {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  return policy.decide(OpCall{op, {}, {}, call_index});
}

TEST(SaveByName, SavesOnlyInsideListedScopes) {
  auto policy = policies::save_by_name({"attn_out", "mlp_out"});
  EXPECT_EQ(decide(*policy), Policy::PreferRecompute);
  {
    NameScope s("attn_out");
    EXPECT_EQ(decide(*policy), Policy::MustSave);
    EXPECT_EQ(decide(*policy, "aten::relu"), Policy::MustSave); // any op in the scope
  }
  {
    NameScope s("mlp_out");
    EXPECT_EQ(decide(*policy), Policy::MustSave);
  }
  {
    NameScope s("other");
    EXPECT_EQ(decide(*policy), Policy::PreferRecompute);
  }
  EXPECT_EQ(decide(*policy), Policy::PreferRecompute);
}

TEST(SaveByName, AnyEnclosingScopeCounts) {
  auto policy = policies::save_by_name({"block"});
  NameScope outer("block");
  NameScope inner("not_listed");
  EXPECT_EQ(decide(*policy), Policy::MustSave);

  auto inner_only = policies::save_by_name({"not_listed"});
  EXPECT_EQ(decide(*inner_only), Policy::MustSave);
}

TEST(SaveByName, RandomMutatingAndAllocatingOpsAreRecomputedInScope) {
  auto policy = policies::save_by_name({"drop"});
  NameScope s("drop");
  EXPECT_EQ(decide(*policy, "aten::bernoulli_", 0, "float"), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::native_dropout"), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::rand"), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::empty_like"), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::empty", 0, "memory_format"), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::div_", 0, "Scalar"), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::mm", 0, "out"), Policy::PreferRecompute);
  // Other ops are saved, factories included.
  EXPECT_EQ(decide(*policy, "aten::mul", 0, "Tensor"), Policy::MustSave);
  EXPECT_EQ(decide(*policy, "aten::zeros"), Policy::MustSave);
}

TEST(SaveByName, NamesInternedLaterAreNotListed) {
  auto policy = policies::save_by_name({"early"});
  NameScope s("a_name_first_seen_after_the_policy");
  EXPECT_EQ(decide(*policy), Policy::PreferRecompute);
}

TEST(SaveByName, EmptyListSavesNothingAndEmptyNameRaises) {
  auto none = policies::save_by_name({});
  NameScope s("anything");
  EXPECT_EQ(decide(*none), Policy::PreferRecompute);
  EXPECT_THROW(policies::save_by_name({"ok", ""}), c10::ValueError);
}

TEST(SaveByName, DescribeListsNamesOnce) {
  EXPECT_EQ(policies::save_by_name({"a", "b", "a"})->describe(), "save_by_name('a', 'b')");
}

TEST(SaveByName, DecisionIgnoresCallIndex) {
  auto policy = policies::save_by_name({"x"});
  NameScope s("x");
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(decide(*policy, "aten::mm", i), Policy::MustSave);
  }
}

TEST(BuiltinPolicies, OnlyEveryNthNeedsTheCallIndex) {
  EXPECT_TRUE(policies::every_nth({{"aten::mm", std::nullopt}}, 2)->needs_call_index());
  EXPECT_FALSE(policies::save_ops({{"aten::mm", std::nullopt}})->needs_call_index());
  EXPECT_FALSE(policies::save_all()->needs_call_index());
  EXPECT_FALSE(policies::recompute_all()->needs_call_index());
  EXPECT_FALSE(policies::save_matmuls()->needs_call_index());
  EXPECT_FALSE(policies::save_by_name({"x"})->needs_call_index());
}

} // namespace
} // namespace torch_sac
