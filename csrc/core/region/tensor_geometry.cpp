#include "tensor_geometry.h"

#include <c10/core/TensorImpl.h>

namespace torch_sac::region {

TensorGeometry TensorGeometry::of(const at::Tensor& t) {
  // Autograd and Python keys are re-derived by TensorImpl or must not be
  // carried over (views are rebuilt below autograd).
  const auto drop = c10::autograd_dispatch_keyset_with_ADInplaceOrView |
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
  return TensorGeometry{
      c10::SmallVector<int64_t, 5>(t.sizes().begin(), t.sizes().end()),
      c10::SmallVector<int64_t, 5>(t.strides().begin(), t.strides().end()),
      t.storage_offset(),
      t.key_set() - drop,
      t.dtype()};
}

at::Tensor TensorGeometry::view_of(const c10::Storage& storage) const {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), key_set, dtype);
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  return at::Tensor(std::move(impl));
}

int64_t TensorGeometry::nbytes() const {
  int64_t n = 1;
  for (int64_t s : sizes) {
    n *= s;
  }
  return n * static_cast<int64_t>(dtype.itemsize());
}

} // namespace torch_sac::region
