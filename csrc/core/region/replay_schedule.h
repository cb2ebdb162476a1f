#pragma once
// A replay schedule: what a region keeps after each rebuild in backward.
//
// Backward asks the region for dropped tensors one unpack at a time; each
// unpack whose tensor is neither alive nor kept runs one rebuild (a replay
// of the tape). A schedule lists, per rebuild in the order they happen
// (counted from 0 in each backward pass), the tensor that rebuild is for and
// which of the other tensors it rebuilds to keep for later unpacks; every
// other tensor it rebuilds is freed after the rebuild and rebuilt again when
// unpacked. A kept tensor is held until its last unpack. The region records
// the schedule it runs (with or without a replay budget), and runs a given
// one exactly, or raises when backward does not match it. Python reads and
// writes it as JSON (torch_sac/schedule.py; format in docs/design.md).

#include <cstdint>
#include <string>
#include <vector>

namespace torch_sac::region {

// A tensor the tape can rebuild, as a user names it: the op call that made
// its storage (op overload and call index within the region, as policies
// see them) and which of that op's tensor outputs it is.
struct TensorKey {
  std::string op; // "aten::mm.default"
  int64_t call_index = 0;
  int32_t output = 0;
  bool operator==(const TensorKey& other) const {
    return call_index == other.call_index && output == other.output && op == other.op;
  }
};

struct RebuildStep {
  TensorKey unpacked;
  std::vector<TensorKey> keep;
  // Tensors kept by earlier rebuilds, still waiting for unpacks, that this
  // one lets go of once it is done (a replay budget does this to stay
  // within its bytes); a later unpack of one rebuilds it again.
  std::vector<TensorKey> release;
};

using ReplaySchedule = std::vector<RebuildStep>;

} // namespace torch_sac::region
