#include "csrc/python/offload_bindings.h"

#include <pybind11/stl.h>

#include "csrc/core/offload/offloader.h"

namespace py = pybind11;

namespace torch_sac::python {

namespace {

void add_copy_times(py::dict& d, const offload::CopyTimes& t) {
  d["d2h_copy_ns"] = t.d2h_ns;
  d["h2d_copy_ns"] = t.h2d_ns;
  d["waited_ns"] = t.waited_ns;
  d["waits"] = t.waits;
}

} // namespace

void register_offload(py::module_& m) {
  m.def("offload_options", [] {
    const offload::OffloadOptions o = offload::options();
    py::dict d;
    d["host_limit_bytes"] = o.host_limit_bytes;
    d["min_bytes"] = o.min_bytes;
    d["prefetch_bytes"] = o.prefetch_bytes;
    d["keep_last_bytes"] = o.keep_last_bytes;
    d["cpu_stand_in"] = o.cpu_stand_in;
    d["time_copies"] = o.time_copies;
    return d;
  });
  m.def(
      "set_offload_options",
      [](int64_t host_limit_bytes, int64_t min_bytes, int64_t prefetch_bytes,
         int64_t keep_last_bytes, bool cpu_stand_in, bool time_copies) {
        offload::set_options(
            {host_limit_bytes, min_bytes, prefetch_bytes, keep_last_bytes, cpu_stand_in,
             time_copies});
      },
      py::arg("host_limit_bytes"), py::arg("min_bytes"), py::arg("prefetch_bytes"),
      py::arg("keep_last_bytes"), py::arg("cpu_stand_in"), py::arg("time_copies"));
  m.def("offload_stats", [] {
    const offload::OffloadStats s = offload::stats();
    py::dict d;
    d["offloaded"] = s.offloaded;
    d["offloaded_bytes"] = s.offloaded_bytes;
    d["deduplicated"] = s.deduplicated;
    d["kept_last"] = s.kept_last;
    d["kept_last_bytes"] = s.kept_last_bytes;
    d["reloaded"] = s.reloaded;
    d["reloaded_bytes"] = s.reloaded_bytes;
    d["prefetched"] = s.prefetched;
    d["late"] = s.late;
    d["late_bytes"] = s.late_bytes;
    d["copying_bytes"] = s.copying_bytes;
    d["peak_copying_bytes"] = s.peak_copying_bytes;
    d["prefetched_bytes"] = s.prefetched_bytes;
    d["peak_prefetched_bytes"] = s.peak_prefetched_bytes;
    d["d2h_ns"] = s.d2h_ns;
    d["h2d_ns"] = s.h2d_ns;
    add_copy_times(d, s.timed);
    d["host_in_use_bytes"] = s.host.in_use_bytes;
    d["host_peak_bytes"] = s.host.peak_in_use_bytes;
    d["host_reserved_bytes"] = s.host.reserved_bytes;
    d["host_peak_reserved_bytes"] = s.host.peak_reserved_bytes;
    d["host_chunks_allocated"] = s.host.chunks_allocated;
    return d;
  });
  // One number per profiler sample: cheaper than the whole dict.
  m.def("offload_copy_times", [] {
    py::dict by_op;
    for (const auto& [op, times] : offload::copy_times_by_op()) {
      py::dict d;
      add_copy_times(d, times);
      by_op[py::str(op)] = d;
    }
    return by_op;
  });
  m.def("offload_host_in_use_bytes", &offload::host_in_use_bytes);
  m.def("offload_reset_peaks", &offload::reset_peaks);
  m.def(
      "offload_synchronize", &offload::synchronize, py::arg("trim"),
      py::call_guard<py::gil_scoped_release>());
}

} // namespace torch_sac::python
