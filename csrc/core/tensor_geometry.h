#pragma once
// How a tensor lies on its storage, so the same view can be rebuilt on a
// replayed copy of that storage.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/SmallVector.h>

namespace torch_sac {

struct TensorGeometry {
  // Inline up to 5 dimensions: one geometry per saved reference and per
  // replay argument, so no heap allocation for the usual shapes.
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  int64_t storage_offset = 0;
  c10::DispatchKeySet key_set; // backend, dtype-independent bits (conj/neg)
  caffe2::TypeMeta dtype;

  static TensorGeometry of(const at::Tensor& t);
  // Whether `storage` is large enough for this geometry.
  bool fits(const c10::Storage& storage) const;
  // A tensor without autograd metadata viewing `storage` with this geometry;
  // raises if the storage is too small.
  at::Tensor view_of(const c10::Storage& storage) const;
  int64_t nbytes() const;
};

} // namespace torch_sac
