#pragma once
// A rebuilt storage the region keeps for later unpacks in this backward pass.
//
// Held strongly while autograd will still unpack the storage, weakly once it
// has unpacked it for the last time: the node that did holds the tensor
// while it runs and may have more saved tensors to rebuild from it
// (BatchNorm unpacks its input, then its mean and invstd, which replay from
// that input), and then frees it, which ends the memo at no cost.

#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>

#include "csrc/core/region/ids.h"
#include "csrc/core/region/stream_sync.h"

namespace torch_sac::region {

class Memo {
 public:
  void hold(c10::Storage storage, StateId state, StreamStamp stream);
  void weaken();
  void clear();
  bool strong() const {
    return static_cast<bool>(strong_);
  }
  // Neither held nor watched: the memo can be forgotten.
  bool gone() const;
  // Set by hold() until clear(): the region lists it among its memos.
  bool listed() const {
    return weak_.has_value();
  }
  // The storage at `state`, if kept, still alive and unmodified, usable on
  // the current stream; a null storage otherwise.
  c10::Storage at_state(StateId state) const;
  // Shared by every tensor handed out on this memo: backward code that
  // writes to one in place (a custom Function) bumps it, and the memo is
  // no longer used.
  const c10::VariableVersion& version() const {
    return version_;
  }
  int64_t strong_bytes() const {
    return strong_ ? static_cast<int64_t>(strong_.nbytes()) : 0;
  }

 private:
  c10::Storage strong_;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> weak_;
  StateId state_; // invalid: none
  StreamStamp stream_;
  c10::VariableVersion version_;
};

} // namespace torch_sac::region
