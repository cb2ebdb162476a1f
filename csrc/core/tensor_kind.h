#pragma once
// Which tensors the engines can record and replay: plain strided tensors.

#include <ATen/core/Tensor.h>

namespace torch_sac {

// nullptr for a tensor the region can record, replay and rebuild (dense,
// strided, on a storage); otherwise what kind of tensor it is, for messages.
// Ops that touch another kind run as if outside the region: their outputs
// are kept as autograd would keep them, never dropped.
inline const char* unrecordable_kind(const at::Tensor& t) {
  if (!t.defined()) {
    return nullptr;
  }
  const c10::DispatchKeySet keys = t.key_set();
  if (keys.has(c10::DispatchKey::Python)) {
    return "a tensor subclass with __torch_dispatch__";
  }
  if (t.is_quantized()) {
    return "a quantized tensor";
  }
  if (t.is_nested()) {
    return "a nested tensor";
  }
  if (t.layout() != c10::kStrided) {
    return "a sparse or mkldnn tensor";
  }
  if (keys.has_any(
          c10::DispatchKeySet(
              {c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
               c10::DispatchKey::BatchedNestedTensor, c10::DispatchKey::Functionalize}))) {
    return "a functorch or functionalization wrapper";
  }
  if (t._is_zerotensor()) {
    return "a ZeroTensor";
  }
  if (!t.has_storage()) {
    return "a tensor without storage";
  }
  return nullptr;
}

} // namespace torch_sac
