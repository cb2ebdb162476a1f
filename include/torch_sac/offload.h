#pragma once
// Offloading saved activations to host memory, for torch_sac's C++ API.
//
// A policy offloads an op's outputs by returning Policy::MustOffload or
// Policy::PreferOffload (or use policies::offload_ops / offload_matmuls):
// they are copied to a pinned host pool on a side stream during forward and
// brought back ahead of their use in backward. These functions set the
// runtime's limits and read what it did, for every region and checkpoint in
// the process:
//
//   auto o = torch_sac::offload::options();
//   o.host_limit_bytes = int64_t{32} << 30;  // at most 32 GiB of host memory
//   torch_sac::offload::set_options(o);
//   ...train...
//   auto s = torch_sac::offload::stats();    // bytes offloaded, late reloads, host pool peak
//
// With o.time_copies = true, copies and the waits of compute on them are
// timed with device events: stats().timed, and copy_times_by_op() per op.
//
// See docs/offload.md for what is offloaded, what is not and why.

#include "csrc/core/offload/offloader.h"
