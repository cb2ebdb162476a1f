#include "csrc/python/budget_bindings.h"

#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "policies/budget_policy.h"
#include "policies/budget_solver.h"

namespace py = pybind11;

namespace torch_sac::python {

void register_budget(py::module_& m) {
  m.def(
      "budget_solve",
      [](std::vector<int64_t> storage_bytes, const std::vector<double>& values,
         const std::vector<std::vector<int64_t>>& item_storages, int64_t capacity,
         const std::string& solver, int64_t max_states, int max_enumeration_bits) {
        TORCH_CHECK_VALUE(
            values.size() == item_storages.size(), "torch_sac.budget_solve: ", values.size(),
            " values but ", item_storages.size(), " storage lists");
        budget::Problem problem;
        problem.storage_bytes = std::move(storage_bytes);
        problem.capacity = capacity;
        problem.items.resize(values.size());
        for (size_t i = 0; i < values.size(); ++i) {
          problem.items[i].value = values[i];
          problem.items[i].storages = item_storages[i];
        }
        budget::Options options;
        options.method = budget::method_from_name(solver);
        options.max_states = max_states;
        options.max_enumeration_bits = max_enumeration_bits;
        budget::Solution sol;
        {
          py::gil_scoped_release no_gil;
          sol = budget::solve(problem, options);
        }
        py::dict d;
        d["chosen"] = sol.chosen;
        d["bytes"] = sol.bytes;
        d["value"] = sol.value;
        d["upper_bound"] = sol.upper_bound;
        d["optimal"] = sol.optimal;
        d["method"] = std::string(budget::method_name(sol.method));
        d["groups"] = sol.groups;
        d["states"] = sol.states;
        d["seconds"] = sol.seconds;
        d["note"] = sol.note;
        return d;
      },
      py::arg("storage_bytes"), py::arg("values"), py::arg("item_storages"), py::arg("capacity"),
      py::arg("solver") = "auto", py::arg("max_states") = budget::Options{}.max_states,
      py::arg("max_enumeration_bits") = budget::Options{}.max_enumeration_bits,
      "Set-union knapsack over op calls (see policies/budget_solver.h).");

  // Python may subclass it (torch_sac.policies.BudgetPolicy) to carry the plan.
  py::class_<policies::SavedCallsPolicy, OpPolicy, std::shared_ptr<policies::SavedCallsPolicy>>(
      m, "SavedCallsPolicy")
      .def(
          py::init([](const std::vector<std::tuple<std::string, std::string, int64_t>>& calls,
                      std::string label,
                      const std::vector<std::tuple<std::string, std::string, int64_t>>& offloaded) {
            std::vector<policies::SavedCall> listed;
            listed.reserve(calls.size() + offloaded.size());
            for (const auto& [name, overload, index] : calls) {
              listed.push_back({c10::OperatorName(name, overload), index});
            }
            for (const auto& [name, overload, index] : offloaded) {
              listed.push_back({c10::OperatorName(name, overload), index, /*offload=*/true});
            }
            return policies::save_calls(listed, std::move(label));
          }),
          py::arg("calls"), py::arg("label") = "",
          py::arg("offloaded") = std::vector<std::tuple<std::string, std::string, int64_t>>{})
      .def_property_readonly("num_saved_calls", &policies::SavedCallsPolicy::size)
      .def_property_readonly("num_offloaded_calls", &policies::SavedCallsPolicy::offloaded);
}

} // namespace torch_sac::python
