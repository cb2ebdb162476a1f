#include "policies/budget_solver.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

namespace torch_sac::budget {
namespace {

// Relative tolerance on values: pruning and "optimal" are up to this.
constexpr double kRelTol = 1e-9;

double tolerance(double v) {
  return kRelTol * std::abs(v);
}

// One way to spend memory on a group: pay `w` bytes, gain `v`, save `items`.
struct Option {
  int64_t w = 0;
  double v = 0;
  std::vector<int32_t> items;
};

struct Group {
  // Pareto-optimal: w ascending, v strictly ascending, 0 < w <= capacity.
  std::vector<Option> options;
  // Indices into `options` of the upper concave hull from (0, 0): the
  // options the LP relaxation uses, with strictly decreasing slopes.
  std::vector<int32_t> hull;
};

// One step along a group's hull: from hull[step - 1] (or nothing) to hull[step].
struct Increment {
  int64_t w = 0;
  double v = 0;
  double slope = 0;
  int32_t group = 0;
  int32_t step = 0;
};

struct Reduced {
  std::vector<Group> groups;
  std::vector<int32_t> free_items; // keep no paid storage: always chosen
  double free_value = 0;
  bool exact = true; // every component enumerated exactly
  std::string note;
  // Increments of all groups, by slope (value density) descending.
  std::vector<Increment> increments;
};

class UnionFind {
 public:
  explicit UnionFind(size_t n) : parent_(n) {
    std::iota(parent_.begin(), parent_.end(), 0);
  }
  int64_t find(int64_t x) {
    while (parent_[x] != x) {
      parent_[x] = parent_[parent_[x]];
      x = parent_[x];
    }
    return x;
  }
  void unite(int64_t a, int64_t b) {
    a = find(a);
    b = find(b);
    if (a != b) {
      parent_[std::max(a, b)] = std::min(a, b);
    }
  }

 private:
  std::vector<int64_t> parent_;
};

void validate(const Problem& p) {
  TORCH_CHECK_VALUE(
      p.capacity >= 0, "torch_sac.budget: capacity must be >= 0 bytes, got ", p.capacity);
  for (size_t s = 0; s < p.storage_bytes.size(); ++s) {
    TORCH_CHECK_VALUE(
        p.storage_bytes[s] >= 0, "torch_sac.budget: storage ", s, " has negative size ",
        p.storage_bytes[s]);
  }
  const auto n_storages = static_cast<int64_t>(p.storage_bytes.size());
  for (size_t i = 0; i < p.items.size(); ++i) {
    const Item& item = p.items[i];
    TORCH_CHECK_VALUE(
        std::isfinite(item.value) && item.value >= 0, "torch_sac.budget: item ", i, " has value ",
        item.value, "; values must be finite and >= 0");
    for (int64_t s : item.storages) {
      TORCH_CHECK_VALUE(
          s >= 0 && s < n_storages, "torch_sac.budget: item ", i, " refers to storage ", s,
          ", but there are ", n_storages, " storages");
    }
  }
}

// Keeps the Pareto-optimal options (no other option is lighter-or-equal and
// at least as valuable), sorted by weight.
void pareto_filter(std::vector<Option>& options) {
  std::sort(options.begin(), options.end(), [](const Option& a, const Option& b) {
    return a.w != b.w ? a.w < b.w : a.v > b.v;
  });
  std::vector<Option> kept;
  double best = 0; // the empty option (0 bytes, 0 value) is always available
  for (auto& o : options) {
    if (o.v > best) {
      best = o.v;
      kept.push_back(std::move(o));
    }
  }
  options = std::move(kept);
}

void build_hull(Group& g) {
  g.hull.clear();
  // Upper concave hull through (0, 0) and the options (w ascending).
  auto point = [&](int32_t idx) -> std::pair<double, double> {
    if (idx < 0) {
      return {0.0, 0.0};
    }
    return {static_cast<double>(g.options[idx].w), g.options[idx].v};
  };
  std::vector<int32_t> hull = {-1};
  for (int32_t i = 0; i < static_cast<int32_t>(g.options.size()); ++i) {
    const auto p = point(i);
    while (hull.size() >= 2) {
      const auto a = point(hull[hull.size() - 2]);
      const auto b = point(hull.back());
      // Drop b unless the slope a->b is strictly greater than b->p.
      if ((b.second - a.second) * (p.first - b.first) <=
          (p.second - b.second) * (b.first - a.first)) {
        hull.pop_back();
      } else {
        break;
      }
    }
    hull.push_back(i);
  }
  g.hull.assign(hull.begin() + 1, hull.end());
}

// The options of one alias component.
struct Component {
  std::vector<int64_t> storages; // global storage indices
  std::vector<int32_t> items;    // global item indices
};

void enumerate_by_storages(
    const Problem& p,
    const Component& c,
    const std::vector<std::vector<int64_t>>& item_storages,
    std::vector<Option>& out) {
  const size_t k = c.storages.size();
  std::vector<uint32_t> item_mask(c.items.size(), 0);
  for (size_t j = 0; j < c.items.size(); ++j) {
    for (int64_t s : item_storages[c.items[j]]) {
      const auto pos = std::lower_bound(c.storages.begin(), c.storages.end(), s) -
          c.storages.begin();
      item_mask[j] |= 1u << pos;
    }
  }
  const uint32_t n_masks = 1u << k;
  std::vector<int64_t> mask_bytes(n_masks, 0);
  struct Candidate {
    int64_t w;
    double v;
    uint32_t mask;
  };
  std::vector<Candidate> candidates;
  for (uint32_t mask = 1; mask < n_masks; ++mask) {
    const int low = __builtin_ctz(mask);
    mask_bytes[mask] = mask_bytes[mask & (mask - 1)] + p.storage_bytes[c.storages[low]];
    if (mask_bytes[mask] > p.capacity) {
      continue;
    }
    double v = 0;
    uint32_t covered = 0;
    for (size_t j = 0; j < item_mask.size(); ++j) {
      if ((item_mask[j] & ~mask) == 0) {
        v += p.items[c.items[j]].value;
        covered |= item_mask[j];
      }
    }
    // Paying for a storage no covered item needs is never useful.
    if (covered == mask && v > 0) {
      candidates.push_back({mask_bytes[mask], v, mask});
    }
  }
  for (const auto& cand : candidates) {
    Option o{cand.w, cand.v, {}};
    for (size_t j = 0; j < item_mask.size(); ++j) {
      if ((item_mask[j] & ~cand.mask) == 0) {
        o.items.push_back(c.items[j]);
      }
    }
    out.push_back(std::move(o));
  }
}

// Item subsets, closed under free riders (items whose storages are all paid).
// Used when a component has few items but many storages.
void enumerate_by_items(
    const Problem& p,
    const Component& c,
    const std::vector<std::vector<int64_t>>& item_storages,
    std::vector<Option>& out) {
  const size_t m = c.items.size();
  const size_t k = c.storages.size();
  std::vector<std::vector<int32_t>> local(m);
  for (size_t j = 0; j < m; ++j) {
    for (int64_t s : item_storages[c.items[j]]) {
      local[j].push_back(
          static_cast<int32_t>(
              std::lower_bound(c.storages.begin(), c.storages.end(), s) - c.storages.begin()));
    }
  }
  std::vector<char> paid(k);
  for (uint32_t subset = 1; subset < (1u << m); ++subset) {
    std::fill(paid.begin(), paid.end(), 0);
    int64_t w = 0;
    for (size_t j = 0; j < m; ++j) {
      if (subset & (1u << j)) {
        for (int32_t s : local[j]) {
          if (!paid[s]) {
            paid[s] = 1;
            w += p.storage_bytes[c.storages[s]];
          }
        }
      }
    }
    if (w > p.capacity) {
      continue;
    }
    Option o{w, 0.0, {}};
    bool closed = true;
    for (size_t j = 0; j < m; ++j) {
      const bool covered = std::all_of(local[j].begin(), local[j].end(), [&](int32_t s) {
        return paid[s] != 0;
      });
      if (covered) {
        if (!(subset & (1u << j))) {
          closed = false; // the closure is another subset, enumerated too
          break;
        }
        o.v += p.items[c.items[j]].value;
        o.items.push_back(c.items[j]);
      }
    }
    if (closed && o.v > 0) {
      out.push_back(std::move(o));
    }
  }
}

// Too large to enumerate: a chain of nested options, each adding the item with
// the best value per extra byte (and every item that then rides free).
void approximate_chain(
    const Problem& p,
    const Component& c,
    const std::vector<std::vector<int64_t>>& item_storages,
    std::vector<Option>& out) {
  std::vector<char> paid(p.storage_bytes.size(), 0);
  std::vector<char> taken(c.items.size(), 0);
  Option cur;
  auto extra_bytes = [&](size_t j) {
    int64_t w = 0;
    for (int64_t s : item_storages[c.items[j]]) {
      if (!paid[s]) {
        w += p.storage_bytes[s];
      }
    }
    return w;
  };
  while (true) {
    int64_t best = -1;
    double best_density = -1;
    for (size_t j = 0; j < c.items.size(); ++j) {
      if (taken[j]) {
        continue;
      }
      const int64_t w = extra_bytes(j);
      if (cur.w + w > p.capacity) {
        continue;
      }
      const double density = w == 0 ? std::numeric_limits<double>::infinity()
                                    : p.items[c.items[j]].value / static_cast<double>(w);
      if (density > best_density) {
        best_density = density;
        best = static_cast<int64_t>(j);
      }
    }
    if (best < 0) {
      break;
    }
    cur.w += extra_bytes(best);
    for (int64_t s : item_storages[c.items[best]]) {
      paid[s] = 1;
    }
    for (size_t j = 0; j < c.items.size(); ++j) {
      if (!taken[j] && extra_bytes(j) == 0) {
        taken[j] = 1;
        cur.v += p.items[c.items[j]].value;
        cur.items.push_back(c.items[j]);
      }
    }
    out.push_back(cur);
  }
}

Reduced reduce(const Problem& p, const Options& opts) {
  Reduced r;
  const size_t n_storages = p.storage_bytes.size();
  // Each item's distinct storages that cost something.
  std::vector<std::vector<int64_t>> item_storages(p.items.size());
  std::vector<int32_t> candidates;
  for (size_t i = 0; i < p.items.size(); ++i) {
    const Item& item = p.items[i];
    if (!(item.value > 0)) {
      continue; // saving it gains nothing
    }
    auto& st = item_storages[i];
    for (int64_t s : item.storages) {
      if (p.storage_bytes[s] > 0) {
        st.push_back(s);
      }
    }
    std::sort(st.begin(), st.end());
    st.erase(std::unique(st.begin(), st.end()), st.end());
    if (st.empty()) {
      r.free_items.push_back(static_cast<int32_t>(i));
      r.free_value += item.value;
    } else {
      candidates.push_back(static_cast<int32_t>(i));
    }
  }
  UnionFind uf(n_storages);
  for (int32_t i : candidates) {
    const auto& st = item_storages[i];
    for (size_t j = 1; j < st.size(); ++j) {
      uf.unite(st[0], st[j]);
    }
  }
  // Components in order of their smallest storage, for determinism.
  std::vector<int64_t> component_of_root(n_storages, -1);
  std::vector<Component> components;
  for (int32_t i : candidates) {
    const int64_t root = uf.find(item_storages[i][0]);
    if (component_of_root[root] < 0) {
      component_of_root[root] = static_cast<int64_t>(components.size());
      components.emplace_back();
    }
    auto& c = components[component_of_root[root]];
    c.items.push_back(i);
    c.storages.insert(c.storages.end(), item_storages[i].begin(), item_storages[i].end());
  }
  const size_t bits = static_cast<size_t>(std::clamp(opts.max_enumeration_bits, 1, 20));
  int64_t approximated = 0;
  for (auto& c : components) {
    std::sort(c.storages.begin(), c.storages.end());
    c.storages.erase(std::unique(c.storages.begin(), c.storages.end()), c.storages.end());
    Group g;
    if (c.storages.size() <= bits) {
      enumerate_by_storages(p, c, item_storages, g.options);
    } else if (c.items.size() <= bits) {
      enumerate_by_items(p, c, item_storages, g.options);
    } else {
      approximate_chain(p, c, item_storages, g.options);
      ++approximated;
    }
    pareto_filter(g.options);
    if (!g.options.empty()) {
      build_hull(g);
      r.groups.push_back(std::move(g));
    }
  }
  if (approximated > 0) {
    r.exact = false;
    r.note = std::to_string(approximated) +
        " alias component(s) too large to enumerate exactly were approximated";
  }
  for (int32_t gi = 0; gi < static_cast<int32_t>(r.groups.size()); ++gi) {
    const Group& g = r.groups[gi];
    int64_t pw = 0;
    double pv = 0;
    for (int32_t step = 0; step < static_cast<int32_t>(g.hull.size()); ++step) {
      const Option& o = g.options[g.hull[step]];
      Increment inc{o.w - pw, o.v - pv, 0, gi, step};
      inc.slope = inc.v / static_cast<double>(inc.w);
      r.increments.push_back(inc);
      pw = o.w;
      pv = o.v;
    }
  }
  std::stable_sort(
      r.increments.begin(), r.increments.end(),
      [](const Increment& a, const Increment& b) { return a.slope > b.slope; });
  return r;
}

// Prefix sums over the increments: the LP bound of any suffix in O(log n).
class LpBound {
 public:
  explicit LpBound(const std::vector<Increment>& incs) : incs_(incs) {
    pw_.assign(incs.size() + 1, 0);
    pv_.assign(incs.size() + 1, 0);
    for (size_t i = 0; i < incs.size(); ++i) {
      pw_[i + 1] = pw_[i] + incs[i].w;
      pv_[i + 1] = pv_[i] + incs[i].v;
    }
  }
  // Max LP value of increments [start, end) within `r` bytes.
  double operator()(size_t start, int64_t r) const {
    const size_t n = incs_.size();
    if (r >= pw_[n] - pw_[start]) {
      return pv_[n] - pv_[start];
    }
    const int64_t key = pw_[start] + r; // < pw_[n]: no overflow
    const size_t j = static_cast<size_t>(
                         std::upper_bound(pw_.begin() + start, pw_.end(), key) - pw_.begin()) -
        1;
    return pv_[j] - pv_[start] + static_cast<double>(key - pw_[j]) * incs_[j].slope;
  }
  // Max LP value of all increments but the one at `skip`, within `r` bytes.
  double without(size_t skip, int64_t r) const {
    if (r < 0) {
      return -std::numeric_limits<double>::infinity();
    }
    if (r <= pw_[skip]) {
      return (*this)(0, r); // the LP stops before reaching `skip`
    }
    return pv_[skip] + (*this)(skip + 1, r - pw_[skip]);
  }

 private:
  const std::vector<Increment>& incs_;
  std::vector<int64_t> pw_;
  std::vector<double> pv_;
};

// Chosen option per group (-1: none).
struct Assignment {
  std::vector<int32_t> choice;
  int64_t w = 0;
  double v = 0;
};

// Moves groups to better options while leftover capacity allows.
void fill_up(
    const Reduced& r,
    const std::vector<int32_t>& group_order,
    int64_t capacity,
    Assignment& a) {
  for (int pass = 0; pass < 4; ++pass) {
    bool improved = false;
    for (int32_t gi : group_order) {
      const Group& g = r.groups[gi];
      const int32_t cur = a.choice[gi];
      const int64_t cw = cur < 0 ? 0 : g.options[cur].w;
      const double cv = cur < 0 ? 0 : g.options[cur].v;
      int32_t best = -1;
      double best_gain = 0;
      for (int32_t o = 0; o < static_cast<int32_t>(g.options.size()); ++o) {
        const double gain = g.options[o].v - cv;
        if (g.options[o].w - cw <= capacity - a.w && gain > best_gain) {
          best_gain = gain;
          best = o;
        }
      }
      if (best >= 0) {
        a.w += g.options[best].w - cw;
        a.v += best_gain;
        a.choice[gi] = best;
        improved = true;
      }
    }
    if (!improved) {
      break;
    }
  }
}

Assignment solve_greedy(const Reduced& r, int64_t capacity) {
  const size_t n_groups = r.groups.size();
  // Groups by their best density, for the fill-up order.
  std::vector<int32_t> group_order;
  group_order.reserve(n_groups);
  for (const Increment& inc : r.increments) {
    if (inc.step == 0) {
      group_order.push_back(inc.group);
    }
  }
  Assignment a;
  a.choice.assign(n_groups, -1);
  std::vector<int32_t> level(n_groups, 0);
  std::vector<char> blocked(n_groups, 0);
  for (const Increment& inc : r.increments) {
    if (blocked[inc.group] || level[inc.group] != inc.step) {
      continue;
    }
    if (a.w + inc.w <= capacity) {
      a.w += inc.w;
      a.v += inc.v;
      ++level[inc.group];
    } else {
      blocked[inc.group] = 1;
    }
  }
  for (size_t g = 0; g < n_groups; ++g) {
    if (level[g] > 0) {
      a.choice[g] = r.groups[g].hull[level[g] - 1];
    }
  }
  fill_up(r, group_order, capacity, a);
  // The single most valuable option (every option fits on its own), filled up.
  int32_t best_group = -1;
  double best_value = a.v;
  for (size_t g = 0; g < n_groups; ++g) {
    const Option& top = r.groups[g].options.back(); // Pareto: most valuable last
    if (top.v > best_value) {
      best_value = top.v;
      best_group = static_cast<int32_t>(g);
    }
  }
  if (best_group >= 0) {
    Assignment single;
    single.choice.assign(n_groups, -1);
    const auto& g = r.groups[best_group];
    single.choice[best_group] = static_cast<int32_t>(g.options.size()) - 1;
    single.w = g.options.back().w;
    single.v = g.options.back().v;
    fill_up(r, group_order, capacity, single);
    if (single.v > a.v) {
      a = std::move(single);
    }
  }
  return a;
}

struct ExactResult {
  bool finished = false;
  Assignment assignment;
  int64_t states = 0;
};

ExactResult solve_exact(
    const Reduced& r,
    int64_t capacity,
    const Assignment& incumbent,
    int64_t max_states) {
  const size_t n_groups = r.groups.size();
  ExactResult result;
  result.assignment = incumbent;
  double lb = incumbent.v;
  const double threshold0 = lb + tolerance(lb);

  // Variable fixing (reduction): for a group with a single option, if the LP
  // bound without it cannot beat the incumbent, every better solution takes
  // it; if the LP bound with it cannot, no better solution takes it. The DP
  // then only sees the remaining "core" groups.
  std::vector<int8_t> fixed(n_groups, 0); // 1: in, -1: out
  {
    const LpBound full(r.increments);
    for (size_t pos = 0; pos < r.increments.size(); ++pos) {
      const Increment& inc = r.increments[pos];
      if (r.groups[inc.group].options.size() != 1) {
        continue;
      }
      if (full.without(pos, capacity) <= threshold0) {
        fixed[inc.group] = 1;
      } else if (inc.v + full.without(pos, capacity - inc.w) <= threshold0) {
        fixed[inc.group] = -1;
      }
    }
  }
  int64_t base_w = 0;
  double base_v = 0;
  for (size_t g = 0; g < n_groups; ++g) {
    if (fixed[g] == 1) {
      base_w += r.groups[g].options[0].w;
      base_v += r.groups[g].options[0].v;
    }
  }
  if (base_w > capacity) {
    // Every better solution would need all of them: there is none.
    result.finished = true;
    return result;
  }
  const int64_t room = capacity - base_w;
  std::vector<Increment> core;
  for (const Increment& inc : r.increments) {
    if (fixed[inc.group] == 0) {
      core.push_back(inc);
    }
  }
  const LpBound lp(core);
  // Core groups in order of their first (densest) increment; the increments
  // of groups order[k..] all lie at or after start[k] in the sorted list, so
  // the LP over that suffix bounds what those groups can still add.
  std::vector<int32_t> order;
  std::vector<size_t> start;
  for (size_t pos = 0; pos < core.size(); ++pos) {
    if (core[pos].step == 0) {
      order.push_back(core[pos].group);
      start.push_back(pos);
    }
  }
  start.push_back(core.size());

  struct Node {
    int32_t parent;
    int32_t group;
    int32_t option;
  };
  struct State {
    int64_t w;
    double v;
    int32_t node;   // decisions so far (for a pending candidate: the parent's)
    int32_t option; // pending: option of the current group taken, -1 if none
  };
  std::vector<Node> arena;
  // Values in the DP are relative to the fixed groups' (base_w, base_v).
  std::vector<State> states = {{0, 0.0, -1, -1}};
  std::vector<State> merged, shifted, next;
  double core_lb = lb - base_v;
  bool improved = false;
  int32_t best_node = -1;

  auto materialize = [&](State& s, int32_t group) {
    if (s.option >= 0) {
      arena.push_back({s.node, group, s.option});
      s.node = static_cast<int32_t>(arena.size()) - 1;
      s.option = -1;
    }
  };

  for (size_t k = 0; k < order.size(); ++k) {
    const int32_t gi = order[k];
    const Group& g = r.groups[gi];
    merged = states;
    for (int32_t o = 0; o < static_cast<int32_t>(g.options.size()); ++o) {
      const Option& opt = g.options[o];
      shifted.clear();
      for (const State& s : states) {
        if (s.w + opt.w > room) {
          break; // states are sorted by weight
        }
        shifted.push_back({s.w + opt.w, s.v + opt.v, s.node, o});
      }
      // Merge, keeping the Pareto front (weight ascending, value strictly ascending).
      next.clear();
      next.reserve(merged.size() + shifted.size());
      size_t i = 0, j = 0;
      double best = -std::numeric_limits<double>::infinity();
      while (i < merged.size() || j < shifted.size()) {
        const State* c;
        if (j >= shifted.size() ||
            (i < merged.size() &&
             (merged[i].w < shifted[j].w ||
              (merged[i].w == shifted[j].w && merged[i].v >= shifted[j].v)))) {
          c = &merged[i++];
        } else {
          c = &shifted[j++];
        }
        if (c->v > best) {
          best = c->v;
          next.push_back(*c);
        }
      }
      merged.swap(next);
      if (result.states + static_cast<int64_t>(merged.size()) > max_states) {
        result.states += static_cast<int64_t>(merged.size());
        result.finished = false;
        return result;
      }
    }
    result.states += static_cast<int64_t>(merged.size());
    // The most valuable state is feasible: a new incumbent?
    State& top = merged.back();
    if (top.v + base_v > lb) {
      lb = top.v + base_v;
      core_lb = top.v;
      materialize(top, gi);
      best_node = top.node;
      improved = true;
    }
    // Keep the states that may still beat the incumbent.
    const size_t next_start = start[k + 1];
    const double threshold = core_lb + tolerance(lb);
    next.clear();
    for (State& s : merged) {
      if (s.v + lp(next_start, room - s.w) <= threshold) {
        continue;
      }
      materialize(s, gi);
      next.push_back(s);
    }
    states.swap(next);
    if (states.empty()) {
      break;
    }
  }
  result.finished = true;
  if (!improved) {
    return result; // the incumbent is optimal
  }
  Assignment a;
  a.choice.assign(n_groups, -1);
  a.w = base_w;
  a.v = base_v;
  for (size_t g = 0; g < n_groups; ++g) {
    if (fixed[g] == 1) {
      a.choice[g] = 0;
    }
  }
  for (int32_t n = best_node; n >= 0; n = arena[n].parent) {
    a.choice[arena[n].group] = arena[n].option;
    a.w += r.groups[arena[n].group].options[arena[n].option].w;
    a.v += r.groups[arena[n].group].options[arena[n].option].v;
  }
  result.assignment = std::move(a);
  return result;
}

// An upper bound valid without the reduction: every item pays an equal share
// of each storage it keeps (sum over items of shares <= sum over paid
// storages), then the LP over independent items.
double relaxed_upper_bound(const Problem& p) {
  std::vector<int64_t> sharers(p.storage_bytes.size(), 0);
  std::vector<std::vector<int64_t>> st(p.items.size());
  for (size_t i = 0; i < p.items.size(); ++i) {
    if (!(p.items[i].value > 0)) {
      continue;
    }
    st[i] = p.items[i].storages;
    std::sort(st[i].begin(), st[i].end());
    st[i].erase(std::unique(st[i].begin(), st[i].end()), st[i].end());
    for (int64_t s : st[i]) {
      ++sharers[s];
    }
  }
  std::vector<std::pair<double, double>> wv; // (weight share, value)
  double bound = 0;
  for (size_t i = 0; i < p.items.size(); ++i) {
    if (!(p.items[i].value > 0)) {
      continue;
    }
    double w = 0;
    for (int64_t s : st[i]) {
      w += static_cast<double>(p.storage_bytes[s]) / static_cast<double>(sharers[s]);
    }
    if (w <= 0) {
      bound += p.items[i].value;
    } else {
      wv.emplace_back(w, p.items[i].value);
    }
  }
  std::sort(wv.begin(), wv.end(), [](const auto& a, const auto& b) {
    return a.second * b.first > b.second * a.first;
  });
  double room = static_cast<double>(p.capacity);
  for (const auto& [w, v] : wv) {
    if (w <= room) {
      room -= w;
      bound += v;
    } else {
      bound += v * room / w;
      break;
    }
  }
  return bound;
}

} // namespace

std::string_view method_name(Method m) {
  switch (m) {
    case Method::Auto:
      return "auto";
    case Method::Exact:
      return "exact";
    case Method::Greedy:
      return "greedy";
  }
  return "?";
}

Method method_from_name(std::string_view name) {
  for (Method m : {Method::Auto, Method::Exact, Method::Greedy}) {
    if (name == method_name(m)) {
      return m;
    }
  }
  TORCH_CHECK_VALUE(
      false, "torch_sac.budget: solver must be 'auto', 'exact' or 'greedy', got '", name, "'");
}

Solution solve(const Problem& problem, const Options& options) {
  const auto t0 = std::chrono::steady_clock::now();
  validate(problem);
  TORCH_CHECK_VALUE(options.max_states > 0, "torch_sac.budget: max_states must be > 0");
  const Reduced r = reduce(problem, options);
  const int64_t capacity = problem.capacity;

  Solution sol;
  sol.groups = static_cast<int64_t>(r.groups.size());
  const Assignment greedy = solve_greedy(r, capacity);
  const double lp = LpBound(r.increments)(0, capacity);

  Method method = options.method;
  if (method == Method::Auto) {
    method = static_cast<int64_t>(problem.items.size()) > options.auto_exact_max_items
        ? Method::Greedy
        : Method::Exact;
    if (method == Method::Greedy) {
      sol.note = "more than " + std::to_string(options.auto_exact_max_items) + " items: greedy";
    }
  }
  Assignment chosen = greedy;
  sol.method = Method::Greedy;
  bool proven = false;
  const bool greedy_is_optimal = r.exact && greedy.v >= lp - tolerance(lp);
  if (method == Method::Exact && greedy_is_optimal) {
    sol.method = Method::Exact; // the LP bound proves the greedy solution optimal
    proven = true;
  } else if (method == Method::Exact) {
    ExactResult exact = solve_exact(r, capacity, greedy, options.max_states);
    sol.states = exact.states;
    if (exact.finished) {
      chosen = std::move(exact.assignment);
      sol.method = Method::Exact;
      proven = true;
    } else {
      TORCH_CHECK(
          options.method != Method::Exact, "torch_sac.budget: the exact solver gave up after ",
          exact.states, " states (max_states=", options.max_states, ") on ", r.groups.size(),
          " groups. Use solver='greedy' or 'auto', or raise max_states.");
      sol.note = "exact solver gave up after " + std::to_string(exact.states) + " states: greedy";
    }
  }

  for (size_t g = 0; g < r.groups.size(); ++g) {
    if (chosen.choice[g] >= 0) {
      const auto& items = r.groups[g].options[chosen.choice[g]].items;
      sol.chosen.insert(sol.chosen.end(), items.begin(), items.end());
    }
  }
  sol.chosen.insert(sol.chosen.end(), r.free_items.begin(), r.free_items.end());
  std::sort(sol.chosen.begin(), sol.chosen.end());
  sol.bytes = chosen.w;
  // Recompute the value from the items, in index order (deterministic sum).
  sol.value = 0;
  for (int64_t i : sol.chosen) {
    sol.value += problem.items[i].value;
  }
  if (r.exact) {
    sol.optimal = proven || chosen.v + r.free_value >= lp + r.free_value - tolerance(lp);
    sol.upper_bound = proven ? sol.value : std::max(sol.value, lp + r.free_value);
  } else {
    sol.optimal = false;
    sol.upper_bound = std::max(sol.value, relaxed_upper_bound(problem));
    sol.note += (sol.note.empty() ? "" : "; ") + r.note;
  }
  sol.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sol;
}

} // namespace torch_sac::budget
