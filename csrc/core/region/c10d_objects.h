#pragma once
// What a region needs of c10d's TorchScript objects to replay a c10d
// collective (`dist.all_gather_into_tensor` into a buffer): the name of the
// ProcessGroup a call was given, and waiting for the Work a call returns.
//
// Alone in this file because c10d's headers pull in all of ATen: the one
// translation unit that includes them.

#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <string>

namespace torch_sac::region {

// The name `pg` (a `__torch__.torch.classes.c10d.ProcessGroup`) is
// registered under, which functional collectives accept; empty when it is
// not a ProcessGroup.
std::string c10d_group_name(const c10::IValue& pg);

// Waits for every c10d Work among `outputs` (a c10d op's returns): the
// op only queues the collective, and `dist`'s Python wrappers wait right
// after it unless asked not to.
void wait_c10d_works(const torch::jit::Stack& outputs);

} // namespace torch_sac::region
