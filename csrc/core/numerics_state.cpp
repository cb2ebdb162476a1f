#include "csrc/core/numerics_state.h"

#include <ATen/Context.h>
#include <c10/core/DefaultDtype.h>

namespace torch_sac {
namespace {

const char* precision_name(uint8_t p) {
  switch (static_cast<at::Float32MatmulPrecision>(p)) {
    case at::Float32MatmulPrecision::HIGHEST:
      return "highest";
    case at::Float32MatmulPrecision::HIGH:
      return "high";
    case at::Float32MatmulPrecision::MEDIUM:
      return "medium";
  }
  return "highest";
}

void apply(const NumericsState& s, const NumericsState& current) {
  auto& ctx = at::globalContext();
  if (s.default_dtype != current.default_dtype) {
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(s.default_dtype));
  }
  if (s.deterministic != current.deterministic ||
      s.deterministic_warn_only != current.deterministic_warn_only) {
    ctx.setDeterministicAlgorithms(s.deterministic, s.deterministic_warn_only);
  }
  if (s.fill_uninitialized != current.fill_uninitialized) {
    ctx.setDeterministicFillUninitializedMemory(s.fill_uninitialized);
  }
  if (s.cudnn_deterministic != current.cudnn_deterministic) {
    ctx.setDeterministicCuDNN(s.cudnn_deterministic);
  }
  if (s.cudnn_benchmark != current.cudnn_benchmark) {
    ctx.setBenchmarkCuDNN(s.cudnn_benchmark);
  }
  if (s.matmul_precision != current.matmul_precision) {
    ctx.setFloat32MatmulPrecision(precision_name(s.matmul_precision));
  }
}

} // namespace

NumericsState NumericsState::current() {
  const auto& ctx = at::globalContext();
  NumericsState s;
  s.default_dtype = c10::get_default_dtype_as_scalartype();
  s.deterministic = ctx.deterministicAlgorithms();
  s.deterministic_warn_only = ctx.deterministicAlgorithmsWarnOnly();
  s.fill_uninitialized = ctx.deterministicFillUninitializedMemory();
  s.cudnn_deterministic = ctx.deterministicCuDNN();
  s.cudnn_benchmark = ctx.benchmarkCuDNN();
  s.matmul_precision = static_cast<uint8_t>(ctx.float32MatmulPrecision());
  return s;
}

NumericsGuard::NumericsGuard(const NumericsState& recorded)
    : saved_(NumericsState::current()), changed_(!(recorded == saved_)) {
  if (changed_) {
    apply(recorded, saved_);
  }
}

NumericsGuard::~NumericsGuard() {
  if (changed_) {
    apply(saved_, NumericsState::current());
  }
}

} // namespace torch_sac
