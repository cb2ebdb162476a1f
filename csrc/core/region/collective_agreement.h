#pragma once
// Replayed collectives must be the same on every rank.
//
// A region replays the functional collectives its policy recomputed
// (all-gathers under sequence parallel), once per backward pass, at the
// first unpack that needs one (replay.cpp). Every rank runs the same
// backward, so the replays line up across ranks, but only if every rank
// recomputed the same collectives in forward. A policy or plan that differs
// per rank would leave one rank waiting in a collective the others never
// run, or replaying them at other points of backward than the others. So
// when a region closes after running a sequence of collectives on a process
// group that its ranks have not yet agreed on in this process, the ranks
// compare which collectives they recompute and which dropped tensors need
// them (one small all-reduce), and all of them raise if that differs. A
// policy whose decisions on such a region change later on some ranks only
// is not caught.
//
// Part of Region (region.h): noted while recording, checked on close().

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "csrc/core/op_facts.h"
#include "csrc/core/region/ids.h"

namespace torch_sac::region {

class CollectiveAgreement {
 public:
  // A collective a replay may run (OpFacts::replayable_collective) ran in
  // forward; `recomputed`: the policy dropped its outputs.
  void note(
      const c10::OperatorHandle& op,
      const OpFacts& facts,
      int64_t call_index,
      c10::ArrayRef<c10::IValue> inputs,
      bool recomputed);
  // A saved tensor was packed (the region's `pack_index`-th) and dropped,
  // and its rebuild may replay `collectives`: backward replays them at the
  // first unpack of such a tensor, so the ranks must drop the same ones.
  void note_dependent_pack(int64_t pack_index, const std::vector<EntryId>& collectives);
  // For each group and sequence of collectives, until the ranks of the
  // group have agreed once in this process: they compare what they
  // recompute and drop. Raises on every rank of the group when it
  // differs. Runs collectives: call it without the region's mutex.
  void check() const;

 private:
  struct Group {
    c10::Device device{c10::kCPU};
    size_t pattern = 0;   // the collectives, in order: the same on every rank
    size_t decisions = 0; // which of them the policy recomputed
    std::vector<std::string> recomputed;
    int64_t collectives = 0;
  };
  std::map<std::string, Group> groups_; // by process group name
  size_t dependent_packs_hash_ = 0;
  int64_t dependent_packs_ = 0;
};

} // namespace torch_sac::region
