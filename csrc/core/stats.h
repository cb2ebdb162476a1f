#pragma once
// The counters each engine reports, each listed once as an X-macro of
// X(name, "what it counts"): the list makes the struct's fields, the Python
// dicts (csrc/python/bindings.cpp iterates the field tables below) and the
// field lists _C.dropin_stat_fields() / _C.region_stat_fields() return to
// the profiler and the docs. Adding a statistic: one X(...) line here, and
// the code that counts it (CONTRIBUTING.md, "Adding a region statistic").
//
// Both engines use the same words: what a drop-in recompute re-runs and what
// a region's replay runs are both "replayed".
//
// No torch headers: installed with the C++ API, and included by its public
// headers (torch_sac::RegionStats).

#include <cstdint>
#include <string>
#include <vector>

namespace torch_sac {

// One counter of `Stats`: its name (the dict key), what it counts, and the
// field holding it.
template <class Stats>
struct StatField {
  const char* name;
  const char* description;
  int64_t Stats::* member;
};

#define TORCH_SAC_STAT_MEMBER(name, description) int64_t name = 0;

// The drop-in (SelectiveCheckpoint, SelectiveContext.stats()).
#define TORCH_SAC_DROPIN_STATS(X)                                                     \
  X(policy_calls, "ops passed to the policy in forward")                              \
  X(saved_ops, "ops whose outputs forward cached")                                    \
  X(saved_bytes, "storage bytes of the outputs forward cached")                       \
  X(offloaded_ops, "ops whose outputs forward offloaded to host memory")              \
  X(offloaded_bytes, "storage bytes of the outputs forward offloaded")                \
  X(offload_fallbacks,                                                                \
    "outputs PREFER_OFFLOAD cached on the device instead (a CPU tensor, a view, "     \
    "below the size threshold)")                                                      \
  X(replayed_ops, "ops recompute re-ran (cache hits not counted)")                    \
  X(cache_hits, "cached outputs handed back during recompute")                        \
  X(invalidated_ops,                                                                  \
    "outputs cached, then written in place later in forward, so recomputed instead")  \
  X(redirected_writes,                                                                \
    "in-place writes recompute made to a copy because forward had already made them " \
    "(BatchNorm's running statistics)")                                               \
  X(replay_ns, "time spent running the ops recompute re-ran, measured in C++ around each")

// Old names of drop-in counters, kept in the dict for one release:
// X(old name, field, "description").
#define TORCH_SAC_DROPIN_STAT_ALIASES(X)                              \
  X(recomputed_ops, replayed_ops, "deprecated alias of replayed_ops") \
  X(recompute_ns, replay_ns, "deprecated alias of replay_ns")

struct SelectiveCacheStats {
  TORCH_SAC_DROPIN_STATS(TORCH_SAC_STAT_MEMBER)
};

#define TORCH_SAC_DROPIN_STAT_FIELD(name, description) \
  {#name, description, &SelectiveCacheStats::name},
#define TORCH_SAC_DROPIN_STAT_ALIAS(alias, field, description) \
  {#alias, description, &SelectiveCacheStats::field},
// The drop-in's dict, in order: its fields, then the aliases.
inline constexpr StatField<SelectiveCacheStats> kDropinStatFields[] = {TORCH_SAC_DROPIN_STATS(
    TORCH_SAC_DROPIN_STAT_FIELD) TORCH_SAC_DROPIN_STAT_ALIASES(TORCH_SAC_DROPIN_STAT_ALIAS)};
#undef TORCH_SAC_DROPIN_STAT_FIELD
#undef TORCH_SAC_DROPIN_STAT_ALIAS

namespace region {

// The region engine (Region::stats(), sac_context.stats(), the C++ API's
// RegionHandle::stats()).
#define TORCH_SAC_REGION_STATS(X)                                                                  \
  X(policy_calls, "ops passed to the policy in forward")                                           \
  X(saved_ops, "ops whose new outputs the policy kept")                                            \
  X(saved_bytes, "storage bytes of the new outputs the policy kept")                               \
  X(dropped_ops, "ops whose new outputs the policy dropped")                                       \
  X(dropped_bytes, "storage bytes of the new outputs the policy dropped")                          \
  X(offloaded_ops, "ops whose new outputs the policy offloaded to host memory")                    \
  X(offloaded_bytes, "storage bytes of the new outputs the policy offloaded")                      \
  X(held_bytes, "copies of outside tensors the region overwrote (BatchNorm's running statistics)") \
  X(packed_kept, "saved tensors autograd holds as usual")                                          \
  X(packed_offloaded, "saved tensors whose storage went to host memory")                           \
  X(held_offloaded, "tensors a replay reads that went to host memory instead of being held")       \
  X(offload_fallbacks,                                                                             \
    "tensors PREFER_OFFLOAD kept on the device instead (a CPU tensor, below the size threshold)")  \
  X(packed_dropped, "saved tensors replaced by a reference")                                       \
  X(unpacked_original, "references served by the still-live original")                             \
  X(replayed_ops, "ops replayed in backward")                                                      \
  X(replay_ns, "time spent replaying them")                                                        \
  X(replayed_cost,                                                                                 \
    "under a replay budget: the replays' estimated cost (nominal ns, replay_cost.h), "             \
    "deterministic where replay_ns is measured")                                                   \
  X(record_ns,                                                                                     \
    "time the region spent recording in forward, outside the ops themselves (the "                 \
    "interception overhead; the adapter's own dispatch not included)")                             \
  X(memo_bytes, "rebuilt tensors the region holds now for unpacks still to come")                  \
  X(peak_memo_bytes, "the most rebuilt tensors the region held at the end of a replay")            \
  X(memos_skipped,                                                                                 \
    "rebuilt tensors autograd still needed that the replay budget (or a nested region's "          \
    "scope) did not let the region keep: each is rebuilt again when unpacked")                     \
  X(peak_held_bytes,                                                                               \
    "with a budget that counts saved outputs: the most the region held at the end of a "           \
    "replay, rebuilt tensors plus live outputs the policy kept")                                   \
  X(budget_choice_ns, "time the replay budget spent choosing what to keep")                        \
  X(spaced_choices,                                                                                \
    "budget choices made by the spaced heuristic rather than the optimal reversal of a "           \
    "chain (replay_budget.h)")                                                                     \
  X(first_rebuild_replayed_ops,                                                                    \
    "ops the first rebuild of the last backward pass replayed (a peak plan checks that "           \
    "its first sweep covered the whole tape)")                                                     \
  X(kept_as_is,                                                                                    \
    "saved tensors of a kind the region cannot rebuild (a subclass without "                       \
    "__tensor_flatten__, quantized, nested, sparse): autograd keeps them as usual "                \
    "(sac_context.kept_as_is() says which kinds)")                                                 \
  X(kept_as_is_bytes, "their storage bytes")                                                       \
  X(collective_ops,                                                                                \
    "collectives forward ran (functional ones and c10d's buffer-filling ones the policy "          \
    "recomputed run again in backward, once a pass, at the first unpack that needs them; other "   \
    "kinds are never replayed)")                                                                   \
  X(collective_bytes, "storage bytes of the collectives' outputs")                                 \
  X(collective_replays, "collectives backward ran again")

struct RegionStats {
  TORCH_SAC_REGION_STATS(TORCH_SAC_STAT_MEMBER)
};

#define TORCH_SAC_REGION_STAT_FIELD(name, description) {#name, description, &RegionStats::name},
inline constexpr StatField<RegionStats> kRegionStatFields[] = {
    TORCH_SAC_REGION_STATS(TORCH_SAC_REGION_STAT_FIELD)};
#undef TORCH_SAC_REGION_STAT_FIELD

// One op overload's row of Region::op_summary() (op_details() in Python,
// where the drop-in's rows have the same keys).
struct RegionOpSummary {
  std::string op;
  int64_t saved = 0;    // calls whose new outputs were kept
  int64_t dropped = 0;  // calls whose new outputs were dropped
  int64_t replayed = 0; // replays in backward
  int64_t saved_bytes = 0;
  int64_t dropped_bytes = 0;
  int64_t replay_ns = 0;
  std::vector<int64_t> replays_by_call; // replays of each forward call, by call index
  int64_t offloaded = 0;                // calls whose new outputs were offloaded to host memory
  int64_t offloaded_bytes = 0;
  // Tensors autograd saved from what it made or wrote that the region kept
  // although the policy would recompute it: it cannot replay the op
  // (`kept_why`); their storage bytes.
  int64_t kept_anyway = 0;
  int64_t kept_anyway_bytes = 0;
  std::string kept_why;
};

} // namespace region
} // namespace torch_sac
