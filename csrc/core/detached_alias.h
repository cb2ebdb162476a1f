#pragma once
// A tensor that shares another's storage and version counter but has no
// autograd metadata.

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

namespace torch_sac {

// Holding the alias keeps the data alive without keeping the autograd graph
// alive (no reference cycle through grad_fn), and in-place writes made through
// any view of the original stay visible through the shared version counter.
inline at::Tensor detached_alias(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  auto* impl = t.unsafeGetTensorImpl();
  // With a TorchDispatchMode on this thread, shallow_copy_and_detach asks
  // the innermost mode to detach. That would show torch_sac's bookkeeping to
  // the user's modes (with the Python-key adapter the region's own mode is
  // popped while it handles an op, so modes entered before the region see
  // it), and a mode gets a wrapped number (`x * 2.0`) as a Python float and
  // cannot detach it. Tensor subclasses (Python key in their own key set)
  // still detach through Python.
  std::optional<c10::impl::ExcludeDispatchKeyGuard> no_modes;
  if (!impl->key_set().has(c10::DispatchKey::Python)) {
    no_modes.emplace(c10::DispatchKey::Python);
  }
  return at::Tensor(impl->shallow_copy_and_detach(
      /*version_counter=*/impl->version_counter(),
      /*allow_tensor_metadata_change=*/false));
}

// How a tensor saved for backward is held: as the very tensor when it does
// not require grad, else as its detached alias. A tensor that does not
// require grad has no grad_fn to make a reference cycle through, and
// autograd hands an unpacked tensor that does not require grad back as is:
// holding the tensor itself is what keeps a frozen nn.Parameter or a tensor
// subclass (a QLoRA weight and its quant_state) the same Python object in
// backward, as plain autograd and torch.utils.checkpoint keep it.
inline at::Tensor held_for_backward(const at::Tensor& t) {
  if (!t.defined() || !t.requires_grad()) {
    return t;
  }
  return detached_alias(t);
}

} // namespace torch_sac
