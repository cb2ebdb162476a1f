// The budget solver (set-union knapsack over op calls) against a brute-force
// oracle, its greedy guarantee, aliasing, and the saved-calls policy.

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <set>

#include "policies/budget_policy.h"
#include "policies/budget_solver.h"

namespace torch_sac::budget {
namespace {

// Bytes of the distinct storages the chosen items keep, and their value.
std::pair<int64_t, double> evaluate(const Problem& p, const std::vector<int64_t>& chosen) {
  std::set<int64_t> storages;
  double value = 0;
  for (int64_t i : chosen) {
    value += p.items[i].value;
    storages.insert(p.items[i].storages.begin(), p.items[i].storages.end());
  }
  int64_t bytes = 0;
  for (int64_t s : storages) {
    bytes += p.storage_bytes[s];
  }
  return {bytes, value};
}

// Optimal value by enumerating every subset of items (n <= 16).
double brute_force(const Problem& p) {
  const size_t n = p.items.size();
  double best = 0;
  std::vector<int64_t> chosen;
  for (uint32_t subset = 0; subset < (1u << n); ++subset) {
    chosen.clear();
    for (size_t i = 0; i < n; ++i) {
      if (subset & (1u << i)) {
        chosen.push_back(static_cast<int64_t>(i));
      }
    }
    auto [bytes, value] = evaluate(p, chosen);
    if (bytes <= p.capacity) {
      best = std::max(best, value);
    }
  }
  return best;
}

enum class Family { Independent, Shared, Correlated, FewSizes };

// Random instances. Shared: items pick 1-3 storages among fewer storages
// than items (views, in-place ops, multi-output ops).
Problem random_problem(std::mt19937_64& rng, size_t n, Family family) {
  Problem p;
  std::uniform_int_distribution<int64_t> size_dist(1, 1000);
  std::uniform_real_distribution<double> value_dist(0.0, 100.0);
  const int64_t sizes[] = {64, 256, 1024, 4096};
  const size_t n_storages = family == Family::Shared ? std::max<size_t>(1, n * 2 / 3) : n;
  for (size_t s = 0; s < n_storages; ++s) {
    p.storage_bytes.push_back(family == Family::FewSizes ? sizes[rng() % 4] : size_dist(rng));
  }
  for (size_t i = 0; i < n; ++i) {
    Item item;
    if (family == Family::Shared) {
      const size_t k = 1 + rng() % 3;
      for (size_t j = 0; j < k; ++j) {
        item.storages.push_back(static_cast<int64_t>(rng() % n_storages));
      }
      if (rng() % 8 == 0) {
        p.storage_bytes[item.storages[0]] = 0; // storage from outside the region
      }
    } else {
      item.storages.push_back(static_cast<int64_t>(i));
    }
    item.value = family == Family::Correlated
        ? static_cast<double>(p.storage_bytes[item.storages[0]]) +
            10.0 * static_cast<double>(rng() % 10)
        : value_dist(rng);
    if (rng() % 10 == 0) {
      item.value = 0;
    }
    p.items.push_back(std::move(item));
  }
  int64_t total = std::accumulate(p.storage_bytes.begin(), p.storage_bytes.end(), int64_t{0});
  p.capacity = static_cast<int64_t>(
      static_cast<double>(total) * std::uniform_real_distribution<double>(0.0, 0.8)(rng));
  return p;
}

void expect_consistent(const Problem& p, const Solution& s) {
  EXPECT_TRUE(std::is_sorted(s.chosen.begin(), s.chosen.end()));
  auto [bytes, value] = evaluate(p, s.chosen);
  EXPECT_EQ(bytes, s.bytes);
  EXPECT_NEAR(value, s.value, 1e-9 * std::max(1.0, value));
  EXPECT_LE(s.bytes, p.capacity);
  EXPECT_GE(s.upper_bound, s.value * (1 - 1e-12));
}

// The largest total value of one alias component: the greedy guarantee's v_max
// is at most this.
double max_component_value(const Problem& p) {
  std::vector<int64_t> parent(p.storage_bytes.size());
  std::iota(parent.begin(), parent.end(), 0);
  std::function<int64_t(int64_t)> find = [&](int64_t x) {
    return parent[x] == x ? x : parent[x] = find(parent[x]);
  };
  for (const auto& item : p.items) {
    for (int64_t s : item.storages) {
      parent[find(s)] = find(item.storages[0]);
    }
  }
  std::vector<double> total(p.storage_bytes.size(), 0);
  double single = 0;
  for (const auto& item : p.items) {
    total[find(item.storages[0])] += item.value;
    single = std::max(single, item.value);
  }
  return std::max(single, *std::max_element(total.begin(), total.end()));
}

TEST(BudgetSolver, ExactMatchesBruteForce) {
  std::mt19937_64 rng(42);
  int n_instances = 0;
  for (Family family :
       {Family::Independent, Family::Shared, Family::Correlated, Family::FewSizes}) {
    for (int rep = 0; rep < 80; ++rep) {
      const size_t n = 1 + rng() % 14;
      const Problem p = random_problem(rng, n, family);
      const double opt = brute_force(p);
      Options o;
      o.method = Method::Exact;
      const Solution s = solve(p, o);
      ASSERT_EQ(s.method, Method::Exact);
      EXPECT_TRUE(s.optimal);
      EXPECT_NEAR(s.value, opt, 1e-9 * std::max(1.0, opt))
          << "family " << static_cast<int>(family) << " rep " << rep;
      expect_consistent(p, s);
      ++n_instances;
    }
  }
  EXPECT_EQ(n_instances, 320);
}

TEST(BudgetSolver, GreedyIsFeasibleAndWithinItsBound) {
  std::mt19937_64 rng(7);
  for (Family family :
       {Family::Independent, Family::Shared, Family::Correlated, Family::FewSizes}) {
    for (int rep = 0; rep < 80; ++rep) {
      const Problem p = random_problem(rng, 1 + rng() % 14, family);
      const double opt = brute_force(p);
      Options o;
      o.method = Method::Greedy;
      const Solution s = solve(p, o);
      ASSERT_EQ(s.method, Method::Greedy);
      expect_consistent(p, s);
      const double tol = 1e-9 * std::max(1.0, opt);
      EXPECT_LE(s.value, opt + tol);
      EXPECT_GE(s.upper_bound, opt - tol); // the LP bound is a certificate
      EXPECT_GE(s.value, opt / 2 - tol);
      EXPECT_GE(s.value, opt - max_component_value(p) - tol);
    }
  }
}

TEST(BudgetSolver, AliasedStorageIsPaidOnce) {
  // Storage 0 (100 B) is allocated by item 0 and aliased by a view (item 1)
  // and an in-place op (item 2); storage 1 is outside the region (0 B).
  Problem p;
  p.storage_bytes = {100, 0, 50};
  p.items = {{5.0, {0}}, {1.0, {0}}, {2.0, {0, 1}}, {3.0, {2}}, {0.5, {1}}};
  p.capacity = 100;
  Solution s = solve(p);
  EXPECT_EQ(s.chosen, (std::vector<int64_t>{0, 1, 2, 4}));
  EXPECT_EQ(s.bytes, 100);
  EXPECT_DOUBLE_EQ(s.value, 8.5);
  EXPECT_TRUE(s.optimal);
  p.capacity = 99;
  s = solve(p);
  EXPECT_EQ(s.chosen, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(s.bytes, 50);
  p.capacity = 150;
  s = solve(p);
  EXPECT_EQ(s.chosen, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(s.bytes, 150);
}

TEST(BudgetSolver, ViewWithoutItsBaseStillPaysForTheStorage) {
  // Only the view is worth saving (the base's value is 0): it keeps the whole
  // storage alive, so it costs the storage's bytes.
  Problem p;
  p.storage_bytes = {100};
  p.items = {{0.0, {0}}, {1.0, {0}}};
  p.capacity = 99;
  EXPECT_TRUE(solve(p).chosen.empty());
  p.capacity = 100;
  EXPECT_EQ(solve(p).chosen, (std::vector<int64_t>{1}));
}

TEST(BudgetSolver, MultiOutputOpsCoupleStorages) {
  // layer_norm-like: item 0 keeps {out, mean, rstd}; item 1 is a view of out.
  Problem p;
  p.storage_bytes = {1000, 10, 10};
  p.items = {{10.0, {0, 1, 2}}, {1.0, {0}}};
  p.capacity = 1000;
  EXPECT_EQ(solve(p).chosen, (std::vector<int64_t>{1}));
  p.capacity = 1020;
  EXPECT_EQ(solve(p).chosen, (std::vector<int64_t>{0, 1}));
}

TEST(BudgetSolver, ZeroBudgetAndEmptyProblems) {
  Problem p;
  p.capacity = 0;
  Solution s = solve(p);
  EXPECT_TRUE(s.chosen.empty());
  EXPECT_TRUE(s.optimal);
  p.storage_bytes = {10, 0};
  p.items = {{1.0, {0}}, {2.0, {1}}, {3.0, {}}};
  s = solve(p);
  EXPECT_EQ(s.chosen, (std::vector<int64_t>{1, 2})); // free items only
  EXPECT_EQ(s.bytes, 0);
}

TEST(BudgetSolver, ValueIsMonotoneInTheBudget) {
  std::mt19937_64 rng(3);
  for (int rep = 0; rep < 20; ++rep) {
    Problem p = random_problem(rng, 60, rep % 2 ? Family::Shared : Family::FewSizes);
    const int64_t total = std::accumulate(
        p.storage_bytes.begin(), p.storage_bytes.end(), int64_t{0});
    double previous = -1;
    for (int step = 0; step <= 20; ++step) {
      p.capacity = total * step / 20;
      const Solution s = solve(p);
      ASSERT_EQ(s.method, Method::Exact);
      expect_consistent(p, s);
      EXPECT_GE(s.value, previous * (1 - 1e-12));
      previous = s.value;
    }
  }
}

TEST(BudgetSolver, LargeInstanceIsSolvedExactly) {
  std::mt19937_64 rng(11);
  Problem p = random_problem(rng, 2000, Family::FewSizes);
  const Solution s = solve(p);
  EXPECT_EQ(s.method, Method::Exact);
  EXPECT_TRUE(s.optimal);
  expect_consistent(p, s);
  Options o;
  o.method = Method::Greedy;
  const Solution g = solve(p, o);
  expect_consistent(p, g);
  EXPECT_LE(g.value, s.value * (1 + 1e-9));
  EXPECT_GE(g.upper_bound, s.value * (1 - 1e-9));
}

TEST(BudgetSolver, StateLimit) {
  std::mt19937_64 rng(5);
  Problem p = random_problem(rng, 200, Family::Correlated);
  Options o;
  o.method = Method::Exact;
  o.max_states = 10;
  EXPECT_THROW(solve(p, o), c10::Error);
  o.method = Method::Auto;
  const Solution s = solve(p, o);
  EXPECT_EQ(s.method, Method::Greedy);
  EXPECT_NE(s.note.find("gave up"), std::string::npos) << s.note;
  expect_consistent(p, s);
}

TEST(BudgetSolver, HugeComponentsAreApproximatedAndSaySo) {
  // 20 storages chained together by 20 items: too large to enumerate with 4 bits.
  Problem p;
  for (int s = 0; s < 20; ++s) {
    p.storage_bytes.push_back(10 + s);
    p.items.push_back({1.0 + s, {s, (s + 1) % 20}});
  }
  p.capacity = 100;
  Options o;
  o.max_enumeration_bits = 4;
  const Solution s = solve(p, o);
  EXPECT_FALSE(s.optimal);
  EXPECT_NE(s.note.find("approximated"), std::string::npos) << s.note;
  expect_consistent(p, s);
  o.max_enumeration_bits = 12; // 20 storages, 20 items: still too many
  EXPECT_FALSE(solve(p, o).optimal);
}

TEST(BudgetSolver, RejectsBadInput) {
  Problem p;
  p.storage_bytes = {10};
  p.items = {{1.0, {0}}};
  p.capacity = -1;
  EXPECT_THROW(solve(p), c10::ValueError);
  p.capacity = 10;
  p.items = {{1.0, {1}}};
  EXPECT_THROW(solve(p), c10::ValueError);
  p.items = {{-1.0, {0}}};
  EXPECT_THROW(solve(p), c10::ValueError);
  p.items = {{std::nan(""), {0}}};
  EXPECT_THROW(solve(p), c10::ValueError);
  p.items = {{1.0, {0}}};
  p.storage_bytes = {-5};
  EXPECT_THROW(solve(p), c10::ValueError);
  EXPECT_THROW(method_from_name("dp"), c10::ValueError);
  EXPECT_EQ(method_from_name("greedy"), Method::Greedy);
}

} // namespace
} // namespace torch_sac::budget

namespace torch_sac::policies {
namespace {

Policy decide(OpPolicy& policy, const char* name, const char* overload, int64_t call_index) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  return policy.decide(OpCall{op, {}, {}, call_index});
}

TEST(SavedCallsPolicy, SavesExactlyTheListedCalls) {
  auto policy = save_calls(
      {{{"aten::mm", ""}, 0},
       {{"aten::mm", ""}, 3},
       {{"aten::add", "Tensor"}, 1},
       {{"myns::not_registered", ""}, 0}},
      "budget(test)");
  EXPECT_EQ(policy->size(), 4);
  EXPECT_EQ(policy->describe(), "budget(test)");
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(
        decide(*policy, "aten::mm", "", i),
        i == 0 || i == 3 ? Policy::MustSave : Policy::PreferRecompute)
        << i;
  }
  EXPECT_EQ(decide(*policy, "aten::add", "Tensor", 1), Policy::MustSave);
  EXPECT_EQ(decide(*policy, "aten::add", "Scalar", 1), Policy::PreferRecompute);
  EXPECT_EQ(decide(*policy, "aten::mul", "Tensor", 0), Policy::PreferRecompute);
  EXPECT_THROW(save_calls({{{"mm", ""}, 0}}), c10::ValueError);
  EXPECT_THROW(save_calls({{{"aten::mm", ""}, -1}}), c10::ValueError);
}

} // namespace
} // namespace torch_sac::policies
