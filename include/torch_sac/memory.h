#pragma once
// Measuring CPU tensor memory: torch_sac's counting CPU allocator.
//
//   torch_sac::install_counting_allocator();   // once, before threads allocate
//   torch_sac::PeakWindow window;              // peak of a block of code
//   ... forward and backward ...
//   window.peak() - window.start();            // highest level above the start
//   torch_sac::cpu_memory_stats().allocated;   // bytes live now
//
// Counts tensor data allocated through c10::GetCPUAllocator() after the
// install; see csrc/core/counting_allocator.h for what bypasses it.

#include "csrc/core/counting_allocator.h"
