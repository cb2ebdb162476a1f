#include "csrc/python/python_policy.h"

#include <torch/csrc/jit/python/pybind_utils.h>

#include <array>

#include "csrc/core/op_name.h"
#include "csrc/python/python_call_view.h"
#include "csrc/python/python_key_adapter.h"
#include "policies/builtin_policies.h"

namespace py = pybind11;

namespace torch_sac::python {
namespace {

// Members in CheckpointPolicy value order: MUST_SAVE, PREFER_SAVE,
// MUST_RECOMPUTE, PREFER_RECOMPUTE, then the offload pair (torch_sac's
// *_OFFLOAD, torch's *_CPU_OFFLOAD, absent from older torch).
struct PolicyEnums {
  std::array<py::object, 6> sac;
  std::vector<py::object> torch;
};
PolicyEnums& policy_enums() {
  static auto* enums = new PolicyEnums();
  return *enums;
}

Policy policy_from_python(PyObject* value, const c10::OperatorHandle& op) {
  const auto& enums = policy_enums();
  for (size_t i = 0; i < enums.sac.size(); ++i) {
    if (value == enums.sac[i].ptr() || (i < enums.torch.size() && value == enums.torch[i].ptr())) {
      return static_cast<Policy>(i);
    }
  }
  if (PyBool_Check(value)) {
    return policy_from_bool(value == Py_True);
  }
  const std::string repr = py::repr(value);
  // ValueError, not TypeError: Python's binary operators turn a TypeError
  // raised inside `x @ w` into "unsupported operand type(s)", hiding this.
  TORCH_CHECK_VALUE(
      false, "torch_sac: the policy returned ", repr, " (type ", Py_TYPE(value)->tp_name, ") for ",
      op_display_name(op),
      "; expected torch_sac.Policy, torch.utils.checkpoint.CheckpointPolicy "
      "or bool.");
}

// A Python number the caller passed where the schema wants a Tensor (`x * 2.0`)
// reaches the dispatcher as a "wrapped number" tensor; __torch_dispatch__
// hands it back to Python as the number, and so does this.
py::object arg_to_python(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number()) {
      switch (t.scalar_type()) {
        case at::kDouble:
          return py::float_(*t.const_data_ptr<double>());
        case at::kLong:
          return py::int_(*t.const_data_ptr<int64_t>());
        case at::kBool:
          return py::bool_(*t.const_data_ptr<bool>());
        default:
          break; // complex and the rest: as a tensor
      }
    }
  }
  return torch::jit::toPyObject(v);
}

// Positional args and kwargs as __torch_dispatch__ would receive them: kwarg-only
// arguments in kwargs, trailing arguments equal to their defaults left out.
// The tuple starts with `leading` empty slots for the caller to fill.
std::pair<py::tuple, py::object> args_kwargs_from_stack(
    const c10::OperatorHandle& op,
    c10::ArrayRef<c10::IValue> inputs,
    size_t leading) {
  const auto& schema_args = op.schema().arguments();
  const auto is_default = [&](size_t i) {
    const auto& def = schema_args[i].default_value();
    if (!def || inputs[i].isTensor()) {
      return false;
    }
    if (def->isNone() || inputs[i].isNone()) {
      return def->isNone() && inputs[i].isNone();
    }
    return def->tagKind() == inputs[i].tagKind() && *def == inputs[i];
  };
  size_t kwarg_start = inputs.size();
  while (kwarg_start > 0 && schema_args[kwarg_start - 1].kwarg_only()) {
    --kwarg_start;
  }
  py::object kwargs; // null when empty: no dict per call
  for (size_t i = kwarg_start; i < inputs.size(); ++i) {
    if (!is_default(i)) {
      if (!kwargs) {
        kwargs = py::dict();
      }
      kwargs[schema_args[i].name().c_str()] = arg_to_python(inputs[i]);
    }
  }
  size_t positional_end = kwarg_start;
  while (positional_end > 0 && is_default(positional_end - 1)) {
    --positional_end;
  }
  py::tuple args(leading + positional_end);
  for (size_t i = 0; i < positional_end; ++i) {
    args[leading + i] = arg_to_python(inputs[i]);
  }
  return {std::move(args), std::move(kwargs)};
}

class PythonPolicy final : public OpPolicy {
 public:
  explicit PythonPolicy(py::object fn) : fn_(std::move(fn)) {}

  ~PythonPolicy() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }

  Policy decide(const OpCall& call) override {
    py::gil_scoped_acquire gil;
    const auto* view = static_cast<const PythonCallView*>(call.adapter_view);
    // fn(ctx, op, *args, **kwargs): one tuple, its first two slots for ctx, op.
    py::object op;
    py::tuple call_args;
    py::object kwargs;
    if (view) {
      op = py::reinterpret_borrow<py::object>(view->func);
      const auto args = py::reinterpret_borrow<py::tuple>(view->args);
      call_args = py::tuple(args.size() + 2);
      for (size_t i = 0; i < args.size(); ++i) {
        call_args[i + 2] = args[i];
      }
      if (view->kwargs != Py_None) {
        kwargs = py::reinterpret_borrow<py::object>(view->kwargs);
      }
    } else {
      op = overload_for(call.op);
      std::tie(call_args, kwargs) = args_kwargs_from_stack(call.op, call.inputs, 2);
    }
    // No outputs for an op that has some: PyTorch's SAC (torch <= 2.11)
    // asked before the op ran, and its own ctx has no op_output then.
    const bool outputs_known = !call.outputs.empty() || call.op.schema().returns().empty();
    call_args[0] = make_context(
        outputs_known ? torch::jit::createPyObjectForStack(
                            torch::jit::Stack(call.outputs.begin(), call.outputs.end()))
                      : py::none());
    call_args[1] = op;
    PyObject* result = PyObject_Call(fn_.ptr(), call_args.ptr(), kwargs.ptr());
    if (!result) {
      throw py::error_already_set();
    }
    auto owned = py::reinterpret_steal<py::object>(result);
    return policy_from_python(owned.ptr(), call.op);
  }

  std::string describe() const override {
    py::gil_scoped_acquire gil;
    return "python_policy(" + py::cast<std::string>(py::repr(fn_)) + ")";
  }

 private:
  // torch's SelectiveCheckpointContext(is_recompute=False, op_output=...),
  // built without running its Python __init__ (one object per op call).
  static py::object make_context(py::object op_output) {
    static auto* cls = new py::object(
        py::module_::import("torch.utils.checkpoint").attr("SelectiveCheckpointContext"));
    static auto* is_recompute = new py::str("is_recompute");
    static auto* op_output_name = new py::str("op_output");
    auto* type = reinterpret_cast<PyTypeObject*>(cls->ptr());
    py::tuple no_args;
    auto ctx = py::reinterpret_steal<py::object>(type->tp_new(type, no_args.ptr(), nullptr));
    if (!ctx || PyObject_SetAttr(ctx.ptr(), is_recompute->ptr(), Py_False) != 0 ||
        PyObject_SetAttr(ctx.ptr(), op_output_name->ptr(), op_output.ptr()) != 0) {
      throw py::error_already_set();
    }
    return ctx;
  }

  py::object fn_;
};

std::vector<policies::OpPattern> to_patterns(const OpPatternList& ops) {
  std::vector<policies::OpPattern> patterns;
  patterns.reserve(ops.size());
  for (const auto& [name, overload] : ops) {
    patterns.push_back({name, overload});
  }
  return patterns;
}

} // namespace

void register_policy_enums(py::object sac_policy, py::object torch_policy) {
  static const char* names[] = {"MUST_SAVE",        "PREFER_SAVE",  "MUST_RECOMPUTE",
                                "PREFER_RECOMPUTE", "MUST_OFFLOAD", "PREFER_OFFLOAD"};
  static const char* torch_names[] = {"MUST_SAVE",        "PREFER_SAVE",      "MUST_RECOMPUTE",
                                      "PREFER_RECOMPUTE", "MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"};
  auto& enums = policy_enums();
  enums.torch.clear();
  for (size_t i = 0; i < enums.sac.size(); ++i) {
    enums.sac[i] = sac_policy.attr(names[i]);
    if (py::hasattr(torch_policy, torch_names[i])) {
      enums.torch.push_back(torch_policy.attr(torch_names[i]));
    }
  }
}

py::object policy_to_python(Policy p) {
  const auto& member = policy_enums().sac[static_cast<size_t>(p)];
  TORCH_CHECK(member, "torch_sac: policy enums are not registered");
  return member;
}

std::shared_ptr<OpPolicy> make_python_policy(py::object fn) {
  TORCH_CHECK_TYPE(
      PyCallable_Check(fn.ptr()), "torch_sac: a policy must be callable, got ",
      py::repr(fn).cast<std::string>());
  return std::make_shared<PythonPolicy>(std::move(fn));
}

std::shared_ptr<OpPolicy> make_save_ops(const OpPatternList& ops) {
  return policies::save_ops(to_patterns(ops));
}

std::shared_ptr<OpPolicy> make_offload_ops(const OpPatternList& ops) {
  return policies::offload_ops(to_patterns(ops));
}

std::shared_ptr<OpPolicy> make_every_nth(const OpPatternList& ops, int64_t n) {
  return policies::every_nth(to_patterns(ops), n);
}

} // namespace torch_sac::python
