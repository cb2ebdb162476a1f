// torch_sac._C: bindings only; the logic lives in csrc/core, policies/ and the
// python_* files beside this one.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "csrc/core/counting_allocator.h"
#include "csrc/core/ignored_ops.h"
#include "csrc/core/interceptor.h"
#include "csrc/core/region/region.h"
#include "csrc/core/selective_cache.h"
#include "csrc/python/budget_bindings.h"
#include "csrc/python/frame_exit_watch.h"
#include "csrc/python/offload_bindings.h"
#include "csrc/python/policy_library.h"
#include "csrc/python/python_key_adapter.h"
#include "csrc/python/python_policy.h"
#include "csrc/python/saved_activation_handle.h"
#include "policies/builtin_policies.h"
#include "torch_sac/version.h" // generated from cmake/version.h.in

namespace py = pybind11;
using namespace torch_sac;

namespace {

// One row of op_details(), the same keys for the region and the drop-in, so
// a profile reads both engines alike.
py::dict op_details_row(const region::RegionOpSummary& s) {
  py::dict d;
  d["op"] = s.op;
  d["saved"] = s.saved;
  d["dropped"] = s.dropped;
  d["replayed"] = s.replayed;
  d["saved_bytes"] = s.saved_bytes;
  d["dropped_bytes"] = s.dropped_bytes;
  d["replay_ns"] = s.replay_ns;
  d["replays_by_call"] = s.replays_by_call;
  d["offloaded"] = s.offloaded;
  d["offloaded_bytes"] = s.offloaded_bytes;
  d["kept_anyway"] = s.kept_anyway;
  d["kept_anyway_bytes"] = s.kept_anyway_bytes;
  d["kept_why"] = s.kept_why;
  return d;
}

// A stats struct as a dict, keyed by its field list (csrc/core/stats.h).
template <class Stats, size_t N>
py::dict stats_dict(const Stats& stats, const StatField<Stats> (&fields)[N]) {
  py::dict d;
  for (const StatField<Stats>& field : fields) {
    d[field.name] = stats.*field.member;
  }
  return d;
}

// [(name, description), ...] of a field list.
template <class Stats, size_t N>
std::vector<std::pair<std::string, std::string>> stat_fields(const StatField<Stats> (&fields)[N]) {
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(N);
  for (const StatField<Stats>& field : fields) {
    out.emplace_back(field.name, field.description);
  }
  return out;
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_sac C++ core";
  // torch_sac.__version__: pyproject.toml's version, as CMake read it.
  m.attr("__version__") = TORCH_SAC_VERSION;
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
  py::class_<CachingHandler, OpHandler, std::shared_ptr<CachingHandler>>(m, "CachingHandler");
  py::class_<CachedHandler, OpHandler, std::shared_ptr<CachedHandler>>(m, "CachedHandler");
  py::class_<SelectiveCheckpoint>(m, "SelectiveCheckpoint")
      .def(
          py::init(&make_selective_checkpoint), py::arg("policy"),
          py::arg("allow_cache_entry_mutation"))
      .def_readonly("caching", &SelectiveCheckpoint::caching)
      .def_readonly("cached", &SelectiveCheckpoint::cached)
      .def("begin_forward", [](SelectiveCheckpoint& self) { self.cache->begin_forward(); })
      .def(
          "finish_forward",
          [](SelectiveCheckpoint& self) {
            self.cache->finish_forward();
            self.caching->release_policy();
          })
      .def("begin_recompute", [](SelectiveCheckpoint& self) { self.cache->begin_recompute(); })
      .def("finish_recompute", [](SelectiveCheckpoint& self) { self.cache->finish_recompute(); })
      .def(
          "stats",
          [](const SelectiveCheckpoint& self) {
            return stats_dict(self.cache->stats(), kDropinStatFields);
          })
      .def(
          "op_summary",
          [](const SelectiveCheckpoint& self) {
            std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> rows;
            for (const auto& s : self.cache->summary()) {
              rows.emplace_back(s.op, s.saved, s.dropped, s.recomputed);
            }
            return rows;
          })
      .def("op_details", [](const SelectiveCheckpoint& self) {
        py::list rows;
        for (const auto& s : self.cache->summary()) {
          // The region's words: calls that made new tensors, their replays.
          rows.append(op_details_row(
              {s.op, s.saved_new, s.dropped_new, s.recomputed, s.saved_bytes, s.dropped_bytes,
               s.recompute_ns, s.recomputes_by_call, s.offloaded_new, s.offloaded_bytes}));
        }
        return rows;
      });

  // The region engine (sac_context). Every call into a Region releases the
  // GIL first (see saved_activation_handle.h for why).
  using NoGil = py::call_guard<py::gil_scoped_release>;
  python::register_saved_activation(m);
  py::class_<region::Region, OpHandler, std::shared_ptr<region::Region>>(m, "Region")
      .def(
          py::init<std::shared_ptr<OpPolicy>, bool, int64_t, bool, double>(), py::arg("policy"),
          py::arg("allow_cache_entry_mutation"),
          py::arg("replay_budget") = region::Region::kNoReplayBudget,
          py::arg("budget_counts_saved") = false,
          py::arg("checkpoint_share") = region::kDefaultCheckpointShare)
      .def("push_policy", &region::Region::push_policy, NoGil())
      .def("pop_policy", &region::Region::pop_policy, NoGil())
      .def("close", &region::Region::close, NoGil())
      .def("pack_hook", &python::pack_hook)
      .def("kept_as_is", &region::Region::kept_as_is, NoGil())
      .def(
          "set_storage_restorer",
          [](region::Region& self, py::object restore, py::object done) {
            // Held by the region: released with the GIL (the region may die on
            // a thread that does not hold it).
            auto restore_fn = std::shared_ptr<py::object>(
                new py::object(std::move(restore)), [](py::object* o) {
                  py::gil_scoped_acquire gil;
                  delete o;
                });
            auto done_fn = std::shared_ptr<py::object>(
                new py::object(std::move(done)), [](py::object* o) {
                  py::gil_scoped_acquire gil;
                  delete o;
                });
            region::Region::StorageRestorer restorer;
            restorer.restore = [restore_fn](const at::Tensor& t) {
              py::gil_scoped_acquire gil;
              return (*restore_fn)(t).cast<bool>();
            };
            restorer.done = [done_fn] {
              py::gil_scoped_acquire gil;
              (*done_fn)();
            };
            py::gil_scoped_release no_gil;
            self.set_storage_restorer(std::move(restorer));
          })
      .def(
          "stats",
          [](const region::Region& self) {
            region::RegionStats s;
            {
              py::gil_scoped_release no_gil;
              s = self.stats();
            }
            return stats_dict(s, region::kRegionStatFields);
          })
      .def(
          "set_replay_schedule",
          [](region::Region& self,
             const std::vector<std::tuple<
                 std::tuple<std::string, int64_t, int32_t>,
                 std::vector<std::tuple<std::string, int64_t, int32_t>>,
                 std::vector<std::tuple<std::string, int64_t, int32_t>>>>& steps) {
            auto key = [](const std::tuple<std::string, int64_t, int32_t>& k) {
              return region::TensorKey{std::get<0>(k), std::get<1>(k), std::get<2>(k)};
            };
            region::ReplaySchedule schedule;
            for (const auto& [unpacked, keep, release] : steps) {
              region::RebuildStep step{key(unpacked), {}, {}};
              for (const auto& k : keep) {
                step.keep.push_back(key(k));
              }
              for (const auto& k : release) {
                step.release.push_back(key(k));
              }
              schedule.push_back(std::move(step));
            }
            py::gil_scoped_release no_gil;
            self.set_replay_schedule(std::move(schedule));
          })
      .def("saved_calls", &region::Region::saved_calls, NoGil())
      .def(
          "executed_schedule",
          [](const region::Region& self) {
            region::ReplaySchedule schedule;
            {
              py::gil_scoped_release no_gil;
              schedule = self.executed_schedule();
            }
            auto key = [](const region::TensorKey& k) {
              return std::make_tuple(k.op, k.call_index, k.output);
            };
            py::list steps;
            for (const auto& step : schedule) {
              py::list keep;
              for (const auto& k : step.keep) {
                keep.append(key(k));
              }
              py::list release;
              for (const auto& k : step.release) {
                release.append(key(k));
              }
              steps.append(py::make_tuple(key(step.unpacked), keep, release));
            }
            return steps;
          })
      .def(
          "op_summary",
          [](const region::Region& self) {
            std::vector<region::RegionOpSummary> summary;
            {
              py::gil_scoped_release no_gil;
              summary = self.op_summary();
            }
            std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> rows;
            for (const auto& s : summary) {
              rows.emplace_back(s.op, s.saved, s.dropped, s.replayed);
            }
            return rows;
          })
      .def("op_details", [](const region::Region& self) {
        std::vector<region::RegionOpSummary> summary;
        {
          py::gil_scoped_release no_gil;
          summary = self.op_summary();
        }
        py::list rows;
        for (const auto& s : summary) {
          rows.append(op_details_row(s));
        }
        return rows;
      });
  // The stats dicts' keys and what each counts, in dict order.
  m.def("dropin_stat_fields", [] { return stat_fields(kDropinStatFields); });
  m.def("region_stat_fields", [] { return stat_fields(region::kRegionStatFields); });

  // While alive on a thread, handlers let ops through (compiled code runs).
  py::class_<OpaqueCodeGuard>(m, "OpaqueCode").def(py::init<>());
  m.def("interception_paused", &interception_paused);

  m.def("key_adapter_unavailable_reason", &key_adapter_unavailable_reason);
  m.def("install_key_adapter", &install_key_adapter);
  m.def("key_adapter_runs_below_modes", &key_adapter_runs_below_modes);
  m.def(
      "built_with_torch", [] { return std::string(TORCH_SAC_TORCH_VERSION); },
      "The torch release (major.minor.patch) whose headers this module was built with.");
  m.def("push_key_handler", &push_key_handler);
  m.def("pop_key_handler", [](const std::shared_ptr<OpHandler>& h) { pop_key_handler(h.get()); });
  m.def("key_handler_depth", &key_handler_depth);
  python::register_handler_mode_base(m);
  python::register_frame_exit_watch(m);

  m.def("register_policy_enums", &python::register_policy_enums);
  m.def("python_policy", &python::make_python_policy);
  m.def("save_ops", &python::make_save_ops);
  m.def("every_nth", &python::make_every_nth);
  m.def("save_all", &policies::save_all);
  m.def("recompute_all", &policies::recompute_all);
  m.def("save_matmuls", &policies::save_matmuls);
  m.def("offload_matmuls", &policies::offload_matmuls);
  m.def("offload_ops", &python::make_offload_ops);
  m.def("matmul_op_names", [] {
    std::vector<std::string> names;
    for (const auto& pattern : policies::matmul_ops()) {
      names.push_back(pattern.name);
    }
    return names;
  });
  m.def("ignored_op_names", [] {
    std::vector<std::pair<std::string, std::string>> names;
    for (const auto& n : ignored_op_names()) {
      names.emplace_back(n.name, n.overload_name);
    }
    return names;
  });
  m.def(
      "add_ignored_ops",
      [](const std::vector<std::pair<std::string, std::string>>& names) {
        std::vector<c10::OperatorName> ops;
        for (const auto& [name, overload] : names) {
          ops.emplace_back(name, overload);
        }
        add_ignored_ops(ops);
      },
      py::arg("names"),
      "Adds (\"ns::name\", overload) pairs to the ignored set; import time only.");

  // ---- Memory measurement (csrc/core/counting_allocator.h; Python API in
  // ---- torch_sac/memory.py) --------------------------------------------
  m.def("install_counting_allocator", [] { install_counting_allocator(); });
  m.def("counting_allocator_installed", [] { return installed_counting_allocator() != nullptr; });
  py::class_<CpuMemoryStats>(m, "CpuMemoryStats")
      .def_readonly("allocated", &CpuMemoryStats::allocated)
      .def_readonly("peak", &CpuMemoryStats::peak)
      .def_readonly("allocs", &CpuMemoryStats::allocs)
      .def_readonly("frees", &CpuMemoryStats::frees);
  m.def("cpu_memory_stats", &cpu_memory_stats);
  m.def("reset_cpu_peak", &reset_cpu_peak);
  py::class_<PeakWindow>(m, "CpuPeakWindow")
      .def(py::init<>())
      .def_property_readonly("start", &PeakWindow::start)
      .def_property_readonly("peak", &PeakWindow::peak)
      .def_property_readonly("current", &PeakWindow::current)
      .def_property_readonly("retained", &PeakWindow::retained)
      .def_property_readonly("is_open", &PeakWindow::is_open)
      .def("close", &PeakWindow::close);
  // ---- end memory measurement -------------------------------------------

  // Policy library: named scopes, save_by_name, OpPolicy.to_torch() bridge.
  python::register_policy_library(m);

  // Budget planner (policies/budget_solver.h).
  python::register_budget(m);
  python::register_offload(m);
}
