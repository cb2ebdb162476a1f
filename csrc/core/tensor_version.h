#pragma once
// A tensor's version counter as autograd checks it, 0 when the counter is
// disabled (inference tensors, some internal tensors).

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>

namespace torch_sac {

inline uint32_t current_version(const c10::VariableVersion& counter) {
  return counter.enabled() ? counter.current_version() : 0;
}

inline uint32_t version_of(const at::Tensor& t) {
  return current_version(t.unsafeGetTensorImpl()->version_counter());
}

} // namespace torch_sac
