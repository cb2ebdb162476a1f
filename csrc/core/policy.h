#pragma once
// The per-op checkpointing decision and how decisions combine.

#include <cstdint>
#include <string_view>

namespace torch_sac {

// Same values as torch.utils.checkpoint.CheckpointPolicy, so the two enums map 1:1.
enum class Policy : uint8_t {
  MustSave = 0,
  PreferSave = 1,
  MustRecompute = 2,
  PreferRecompute = 3,
};

inline bool is_save(Policy p) {
  return p == Policy::MustSave || p == Policy::PreferSave;
}

inline bool is_must(Policy p) {
  return p == Policy::MustSave || p == Policy::MustRecompute;
}

// torch's convention for policies that return a bool.
inline Policy policy_from_bool(bool save) {
  return save ? Policy::MustSave : Policy::PreferRecompute;
}

std::string_view policy_name(Policy p);

// Decision of stacked (nested) policies: MUST beats PREFER, the innermost
// PREFER wins, and two different MUSTs are a conflict that raises, naming
// `op_name`.
Policy combine_policies(Policy outer, Policy inner, std::string_view op_name);

} // namespace torch_sac
