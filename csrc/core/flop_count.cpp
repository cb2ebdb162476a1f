#include "csrc/core/flop_count.h"

#include <string>

namespace torch_sac {
namespace {

// Nested tensors and symbolic shapes have no concrete sizes to read (sizes()
// throws): their calls count 0, like ops the formulas do not know.
c10::IntArrayRef shape(const c10::IValue& v) {
  if (!v.isTensor()) {
    return {};
  }
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return {};
  }
  return t.sizes();
}

// (m, k) @ (k, n): 2mnk, as flop_counter counts (multiply and add).
double mm_flops(c10::IntArrayRef a, c10::IntArrayRef b) {
  if (a.size() != 2 || b.size() != 2 || a[1] != b[0]) {
    return 0;
  }
  return 2.0 * static_cast<double>(a[0]) * static_cast<double>(b[1]) * static_cast<double>(a[1]);
}

double bmm_flops(c10::IntArrayRef a, c10::IntArrayRef b) {
  if (a.size() != 3 || b.size() != 3 || a[0] != b[0] || a[2] != b[1]) {
    return 0;
  }
  return 2.0 * static_cast<double>(a[0]) * static_cast<double>(a[1]) * static_cast<double>(b[2]) *
      static_cast<double>(a[2]);
}

// flop_counter's conv_flop_count: 2 * batch * c_out * c_in * filter size *
// positions (output positions, input positions when transposed).
double conv_flops(c10::IntArrayRef x, c10::IntArrayRef w, c10::IntArrayRef out, bool transposed) {
  const c10::IntArrayRef positions = transposed ? x : out;
  if (x.size() < 2 || w.size() < 2 || positions.size() < 2) {
    return 0;
  }
  double flops = 2.0 * static_cast<double>(x[0]);
  for (int64_t d : w) {
    flops *= static_cast<double>(d);
  }
  for (size_t i = 2; i < positions.size(); ++i) {
    flops *= static_cast<double>(positions[i]);
  }
  return flops;
}

} // namespace

double count_flops(
    const c10::OperatorHandle& op,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs) {
  const std::string& name = op.operator_name().name;
  // By packet, every overload (out= ones take the same leading arguments).
  if ((name == "aten::mm" || name == "aten::_scaled_mm") && inputs.size() >= 2) {
    return mm_flops(shape(inputs[0]), shape(inputs[1]));
  }
  if (name == "aten::addmm" && inputs.size() >= 3) {
    return mm_flops(shape(inputs[1]), shape(inputs[2]));
  }
  if (name == "aten::bmm" && inputs.size() >= 2) {
    return bmm_flops(shape(inputs[0]), shape(inputs[1]));
  }
  if (name == "aten::baddbmm" && inputs.size() >= 3) {
    return bmm_flops(shape(inputs[1]), shape(inputs[2]));
  }
  // input, weight, bias, stride, padding, dilation, transposed, ...
  if ((name == "aten::convolution" || name == "aten::_convolution" ||
       name == "aten::convolution_overrideable") &&
      inputs.size() >= 7 && inputs[6].isBool() && !outputs.empty()) {
    return conv_flops(shape(inputs[0]), shape(inputs[1]), shape(outputs[0]), inputs[6].toBool());
  }
  return 0;
}

} // namespace torch_sac
