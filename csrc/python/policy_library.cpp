// Bindings for the policy library: named scopes, save_by_name, and the
// bridge that lets a C++ policy answer PyTorch's own SAC
// (OpPolicy.to_torch(), implemented in torch_sac/_torch_policy.py).

#include "csrc/python/policy_library.h"

#include <pybind11/stl.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "csrc/core/name_scope.h"
#include "csrc/core/selective_cache.h"
#include "csrc/python/python_call_view.h"
#include "csrc/python/python_key_adapter.h"
#include "policies/builtin_policies.h"

namespace py = pybind11;

namespace torch_sac::python {
namespace {

// The op's outputs as IValues, from the Python object the op returned;
// none when `output` is None: PyTorch's SAC of torch <= 2.11 asks its
// policy_fn before the op runs (see torch_sac/_compat.py).
std::vector<c10::IValue> outputs_from_python(
    const c10::FunctionSchema& schema,
    const py::handle& output) {
  const auto& returns = schema.returns();
  std::vector<c10::IValue> values;
  if (output.is_none()) {
    return values;
  }
  values.reserve(returns.size());
  if (returns.size() == 1) {
    values.push_back(torch::jit::toIValue(output, returns[0].type()));
  } else if (!returns.empty()) {
    const auto items = py::reinterpret_borrow<py::sequence>(output);
    TORCH_CHECK(
        static_cast<size_t>(py::len(items)) == returns.size(), "torch_sac: ", schema.name(),
        " returned ", py::len(items), " values, its schema has ", returns.size());
    for (size_t i = 0; i < returns.size(); ++i) {
      values.push_back(torch::jit::toIValue(items[i], returns[i].type()));
    }
  }
  return values;
}

// The decision of `policy` for one op that PyTorch's SAC reports with its
// policy_fn signature. `names`, when given, replaces this thread's scope
// stack for the decision (under torch.compile the scopes come from FX node
// metadata). Returns the Policy value (= CheckpointPolicy value); ops that
// are not dispatcher operators (HigherOrderOperators) get PREFER_RECOMPUTE,
// as torch_sac's own interception never shows them to a policy.
int decide_for_torch(
    OpPolicy& policy,
    const py::handle& func,
    const py::tuple& args,
    const py::object& kwargs,
    const py::object& output,
    int64_t call_index,
    const std::optional<std::vector<std::string>>& names) {
  const auto op = operator_for(func.ptr());
  if (!op) {
    return static_cast<int>(Policy::PreferRecompute);
  }
  torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(true);
  torch::jit::Stack inputs = torch::jit::createStackForSchema(
      op->schema(), args,
      kwargs.is_none() ? py::kwargs() : py::reinterpret_borrow<py::kwargs>(kwargs), std::nullopt);
  const std::vector<c10::IValue> outputs = outputs_from_python(op->schema(), output);
  const PythonCallView view{func.ptr(), args.ptr(), kwargs.ptr()};
  const OpCall call{*op, inputs, outputs, call_index, &view};
  if (!names) {
    return static_cast<int>(policy.decide(call));
  }
  std::vector<NameId> ids;
  ids.reserve(names->size());
  for (const auto& name : *names) {
    ids.push_back(intern_name(name));
  }
  NameStackOverride scopes(std::move(ids));
  return static_cast<int>(policy.decide(call));
}

} // namespace

void register_policy_library(py::module_& m) {
  // Named scopes (torch_sac.name).
  m.def(
      "intern_name", [](const std::string& name) { return intern_name(name); },
      "The id of a scope name (the same for the same string).");
  m.def(
      "push_name", &push_name, py::arg("id"),
      "Opens a scope on this thread; returns the token pop_name needs.");
  m.def(
      "pop_name", &pop_name, py::arg("id"), py::arg("depth"),
      "Closes the scope push_name opened; raises if closed out of order.");
  m.def(
      "active_names",
      [] {
        std::vector<std::string> names;
        for (const NameId id : active_names()) {
          names.push_back(name_string(id));
        }
        return names;
      },
      "The scope names open on this thread, outermost first.");

  m.def("save_by_name", &policies::save_by_name, py::arg("names"));

  // Policies answering PyTorch's SAC (OpPolicy.to_torch).
  py::object op_policy = m.attr("OpPolicy");
  py::setattr(
      op_policy, "_needs_call_index",
      py::cpp_function(
          [](const OpPolicy& self) { return self.needs_call_index(); }, py::is_method(op_policy),
          py::name("_needs_call_index"),
          py::sibling(py::getattr(op_policy, "_needs_call_index", py::none()))));
  py::setattr(
      op_policy, "_decide_torch",
      py::cpp_function(
          &decide_for_torch, py::is_method(op_policy), py::name("_decide_torch"), py::arg("op"),
          py::arg("args"), py::arg("kwargs"), py::arg("output"), py::arg("call_index"),
          py::arg("names"), py::sibling(py::getattr(op_policy, "_decide_torch", py::none()))));

  // What forward cached, per (op, call index): SelectiveCheckpoint.saved_calls().
  py::object checkpoint = m.attr("SelectiveCheckpoint");
  py::setattr(
      checkpoint, "saved_calls",
      py::cpp_function(
          [](const SelectiveCheckpoint& self) {
            std::vector<std::pair<py::object, int64_t>> calls;
            for (const auto& [op, index] : self.cache->saved_calls()) {
              calls.emplace_back(overload_for(op), index);
            }
            return calls;
          },
          py::is_method(checkpoint), py::name("saved_calls"),
          py::sibling(py::getattr(checkpoint, "saved_calls", py::none()))));
}

} // namespace torch_sac::python
