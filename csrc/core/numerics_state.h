#pragma once
// Process-wide settings that change what an op computes without being one of
// its arguments: the default dtype (a factory op without `dtype=`), the
// deterministic-algorithms switches and float32 matmul precision. A region
// captures them with each replayable tape entry and puts them back for its
// replay; the drop-in captures them when forward starts and runs recompute
// under them. So a setting changed between forward and backward cannot
// change a rebuilt tensor.
//
// Thread-local settings are not here because replay does not need them:
// grad mode and autocast are off in replay (ReplayGuard; the drop-in's
// recompute gets them from torch.utils.checkpoint), and functorch transforms
// wrap tensors the region does not record (tensor_kind.h).

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace torch_sac {

struct NumericsState {
  c10::ScalarType default_dtype = c10::ScalarType::Float;
  bool deterministic = false;
  bool deterministic_warn_only = false;
  bool fill_uninitialized = false;
  bool cudnn_deterministic = false;
  bool cudnn_benchmark = false;
  uint8_t matmul_precision = 0; // at::Float32MatmulPrecision

  static NumericsState current();
  bool operator==(const NumericsState& other) const = default;
};

// Sets the recorded state for a replay when it differs from the current
// one, and restores the current one afterwards.
class NumericsGuard {
 public:
  explicit NumericsGuard(const NumericsState& recorded);
  ~NumericsGuard();
  NumericsGuard(const NumericsGuard&) = delete;
  NumericsGuard& operator=(const NumericsGuard&) = delete;

 private:
  NumericsState saved_;
  bool changed_;
};

} // namespace torch_sac
