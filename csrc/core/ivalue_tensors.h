#pragma once
// Walking the tensors held by an op argument or output: Tensor, Tensor?,
// Tensor[] and Tensor?[].

#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>

namespace torch_sac {

// Calls fn(tensor) for every tensor in `value`, in order (None elements of
// Tensor?[] are skipped, as map_tensors leaves them alone). Every op argument
// passes through here: a Tensor[] is walked as the list of IValues it is,
// since isTensorList() is an out-of-line call (reading the element type) that
// would be paid by every scalar argument too.
template <typename Fn>
void for_each_tensor(const c10::IValue& value, Fn&& fn) {
  if (value.isTensor()) {
    fn(value.toTensor());
  } else if (value.isList()) {
    for (const c10::IValue& v : value.toListRef()) {
      for_each_tensor(v, fn);
    }
  }
}

// `value` with every tensor replaced by fn(tensor). Lists are copied, never
// shared with `value`.
template <typename Fn>
c10::IValue map_tensors(const c10::IValue& value, Fn&& fn) {
  if (value.isTensor()) {
    return fn(value.toTensor());
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    out.reserve(value.toTensorList().size());
    for (const at::Tensor& t : value.toTensorList()) {
      out.push_back(fn(t));
    }
    return out;
  }
  if (value.isList()) {
    c10::impl::GenericList out(value.toList().elementType());
    out.reserve(value.toListRef().size());
    for (const c10::IValue& v : value.toListRef()) {
      out.push_back(v.isNone() ? v : map_tensors(v, fn));
    }
    return out;
  }
  return value;
}

} // namespace torch_sac
