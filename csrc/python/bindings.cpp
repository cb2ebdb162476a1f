// torch_sac._C: bindings only; the logic lives in csrc/core, policies/ and the
// python_* files beside this one.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>

#include "csrc/core/ignored_ops.h"
#include "csrc/core/interceptor.h"
#include "csrc/core/selective_cache.h"
#include "policies/builtin_policies.h"
#include "python_key_adapter.h"
#include "python_policy.h"
// --- budget planner (branch budget) ---
#include "budget_bindings.h"
// --- end budget planner ---

namespace py = pybind11;
using namespace torch_sac;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_sac C++ core";
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) {
        std::rethrow_exception(error);
      }
    } catch (const c10::Error&) {
      torch::translate_exception_to_python(std::current_exception());
      throw py::error_already_set();
    }
  });

  py::class_<OpPolicy, std::shared_ptr<OpPolicy>>(m, "OpPolicy")
      .def("__repr__", &OpPolicy::describe);
  py::class_<OpHandler, std::shared_ptr<OpHandler>>(m, "OpHandler");
  py::class_<CachingHandler, OpHandler, std::shared_ptr<CachingHandler>>(
      m, "CachingHandler");
  py::class_<CachedHandler, OpHandler, std::shared_ptr<CachedHandler>>(
      m, "CachedHandler")
      .def("reset_call_counts", &CachedHandler::reset_call_counts);
  py::class_<SelectiveCheckpoint>(m, "SelectiveCheckpoint")
      .def(py::init(&make_selective_checkpoint), py::arg("policy"),
           py::arg("allow_cache_entry_mutation"))
      .def_readonly("caching", &SelectiveCheckpoint::caching)
      .def_readonly("cached", &SelectiveCheckpoint::cached)
      .def("stats", [](const SelectiveCheckpoint& self) {
        const auto& s = self.cache->stats();
        py::dict d;
        d["policy_calls"] = s.policy_calls;
        d["saved_ops"] = s.saved_ops;
        d["saved_bytes"] = s.saved_bytes;
        d["recomputed_ops"] = s.recomputed_ops;
        d["cache_hits"] = s.cache_hits;
        return d;
      })
      .def("op_summary", [](const SelectiveCheckpoint& self) {
        std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> rows;
        for (const auto& s : self.cache->summary()) {
          rows.emplace_back(s.op, s.saved, s.dropped, s.recomputed);
        }
        return rows;
      });

  m.def("key_adapter_unavailable_reason", &key_adapter_unavailable_reason);
  m.def("install_key_adapter", &install_key_adapter);
  m.def("push_key_handler", &push_key_handler);
  m.def("pop_key_handler", [](const std::shared_ptr<OpHandler>& h) {
    pop_key_handler(h.get());
  });
  m.def("key_handler_depth", &key_handler_depth);
  python::register_handler_mode_base(m);

  m.def("register_policy_enums", &python::register_policy_enums);
  m.def("python_policy", &python::make_python_policy);
  m.def("save_ops", &python::make_save_ops);
  m.def("every_nth", &python::make_every_nth);
  m.def("save_all", &policies::save_all);
  m.def("recompute_all", &policies::recompute_all);
  m.def("save_matmuls", &policies::save_matmuls);
  m.def("ignored_op_names", [] {
    std::vector<std::pair<std::string, std::string>> names;
    for (const auto& n : ignored_op_names()) {
      names.emplace_back(n.name, n.overload_name);
    }
    return names;
  });

  // --- budget planner (branch budget) ---
  python::register_budget(m);
  // --- end budget planner ---
}
