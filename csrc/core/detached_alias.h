#pragma once
// A tensor that shares another's storage and version counter but has no
// autograd metadata.

#include <ATen/core/Tensor.h>

namespace torch_sac {

// Holding the alias keeps the data alive without keeping the autograd graph
// alive (no reference cycle through grad_fn), and in-place writes made through
// any view of the original stay visible through the shared version counter.
inline at::Tensor detached_alias(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  auto* impl = t.unsafeGetTensorImpl();
  return at::Tensor(impl->shallow_copy_and_detach(
      /*version_counter=*/impl->version_counter(),
      /*allow_tensor_metadata_change=*/false));
}

} // namespace torch_sac
