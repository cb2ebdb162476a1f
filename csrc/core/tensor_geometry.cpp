#include "csrc/core/tensor_geometry.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

namespace torch_sac {

TensorGeometry TensorGeometry::of(const at::Tensor& t) {
  // Autograd and Python keys are re-derived by TensorImpl or must not be
  // carried over (views are rebuilt below autograd).
  const auto drop = c10::autograd_dispatch_keyset_with_ADInplaceOrView |
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
  return TensorGeometry{
      c10::SmallVector<int64_t, 5>(t.sizes().begin(), t.sizes().end()),
      c10::SmallVector<int64_t, 5>(t.strides().begin(), t.strides().end()), t.storage_offset(),
      t.key_set() - drop, t.dtype()};
}

namespace {

int64_t bytes_needed(const TensorGeometry& g) {
  int64_t last = g.storage_offset;
  for (size_t d = 0; d < g.sizes.size(); ++d) {
    if (g.sizes[d] == 0) {
      return 0;
    }
    last += (g.sizes[d] - 1) * g.strides[d];
  }
  return (last + 1) * static_cast<int64_t>(g.dtype.itemsize());
}

} // namespace

bool TensorGeometry::fits(const c10::Storage& storage) const {
  return bytes_needed(*this) <= static_cast<int64_t>(storage.nbytes());
}

at::Tensor TensorGeometry::view_of(const c10::Storage& storage) const {
  // Replay can make a smaller storage than forward did (a data-dependent
  // shape, nonzero after different inputs): never view past its end.
  TORCH_CHECK(
      fits(storage), "torch_sac: a replayed op rebuilt a tensor of ", storage.nbytes(),
      " bytes where forward "
      "made at least ",
      bytes_needed(*this), " (shape ", c10::IntArrayRef(sizes),
      "): replay "
      "is not deterministic here (data-dependent shapes after inputs changed, or different "
      "global state). Make the policy save the op that makes this tensor.");
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

} // namespace torch_sac
