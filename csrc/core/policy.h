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
  // Keep the outputs for backward in host memory (csrc/core/offload/): torch's
  // MUST_CPU_OFFLOAD and PREFER_CPU_OFFLOAD. A PREFER that cannot be honoured
  // (a CPU tensor, one below the size threshold) falls back to save.
  MustOffload = 4,
  PreferOffload = 5,
};

inline bool is_save(Policy p) {
  return p == Policy::MustSave || p == Policy::PreferSave;
}

inline bool is_offload(Policy p) {
  return p == Policy::MustOffload || p == Policy::PreferOffload;
}

// Whether backward gets the outputs without recomputing them: saved on the
// device or offloaded to host memory.
inline bool is_kept(Policy p) {
  return is_save(p) || is_offload(p);
}

inline bool is_must(Policy p) {
  return p == Policy::MustSave || p == Policy::MustRecompute || p == Policy::MustOffload;
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
