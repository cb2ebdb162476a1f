#include "csrc/core/region/memo.h"

#include "csrc/core/tensor_version.h"

namespace torch_sac::region {

void Memo::hold(c10::Storage storage, StateId state, StreamStamp stream) {
  weak_.emplace(storage.getWeakStorageImpl());
  strong_ = std::move(storage);
  state_ = state;
  stream_ = stream;
  version_ = c10::VariableVersion(/*version=*/0);
}

void Memo::weaken() {
  strong_ = c10::Storage();
}

void Memo::clear() {
  strong_ = c10::Storage();
  weak_.reset();
  state_ = StateId::invalid();
}

bool Memo::gone() const {
  return !strong_ && (!weak_ || weak_->expired());
}

c10::Storage Memo::at_state(StateId state) const {
  if (state != state_ || current_version(version_) != 0) {
    return c10::Storage();
  }
  c10::Storage storage = strong_;
  if (!storage && weak_) {
    auto alive = weak_->lock();
    if (alive) {
      storage = c10::Storage(std::move(alive));
    }
  }
  if (storage) {
    stream_.hand_over(storage);
  }
  return storage;
}

} // namespace torch_sac::region
