#pragma once
// A tensor's version counter as autograd checks it, 0 when the counter is
// disabled (inference tensors, some internal tensors).

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string_view>

namespace torch_sac {

inline uint32_t current_version(const c10::VariableVersion& counter) {
  return counter.enabled() ? counter.current_version() : 0;
}

inline uint32_t version_of(const at::Tensor& t) {
  return current_version(t.unsafeGetTensorImpl()->version_counter());
}

// Autograd's error for a tensor saved for backward and modified in place
// since (its wording, which users search for), with what torch_sac did with
// the tensor: `what` names it ("a tensor of shape [2, 3]"), `how` is said in
// parentheses. Called only on failure: building `what` costs.
[[noreturn]] inline void throw_modified_in_place(
    std::string_view what,
    uint32_t now,
    uint32_t expected,
    std::string_view how) {
  TORCH_CHECK(
      false,
      "one of the variables needed for gradient computation has been modified by an inplace "
      "operation: ",
      what, " is at version ", now, "; expected version ", expected, " instead. (torch_sac: ", how,
      ".) Hint: enable anomaly detection with torch.autograd.set_detect_anomaly(True) to find "
      "the operation that failed to compute its gradient.");
}

} // namespace torch_sac
