#pragma once
// torch_sac's C++ (LibTorch) API: selective activation checkpointing for
// C++-only training. No Python: link TorchSac::torch_sac and libtorch.
//
//   #include <torch_sac/torch_sac.h>
//
//   for (auto& block : blocks) {
//     torch_sac::SacContext region(torch_sac::policies::save_matmuls());
//     x = block->forward(x);
//   }
//   loss.backward();
//
// sac_context.h: SacContext (a region), checkpoint(), RegionHandle (stats, op_details)
// policies.h:    built-in policies, C++ callable policies, NameScope
// budget.h:      policies::budget, the memory-budget plan (profile, then solve)
// memory.h:      the counting CPU allocator and PeakWindow
// offload.h:     offloading saved activations to host memory (options, stats)

#include "torch_sac/budget.h"
#include "torch_sac/memory.h"
#include "torch_sac/offload.h"
#include "torch_sac/policies.h"
#include "torch_sac/sac_context.h"
#include "torch_sac/version.h"
