#pragma once
// Rebuilt tensors are made on the stream backward happens to run on when a
// replay starts, and can be handed to a node that runs on another stream
// (autograd runs each node on its forward op's stream). Handing one over
// orders the consumer's stream after the producer's and tells the caching
// allocator the memory is in use there. No-ops on CPU.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <optional>

namespace torch_sac::region {

// A tensor kept from forward that a replay reads on the current stream: the
// caching allocator must not hand its memory out again until that stream is
// done with it (the region may drop its reference right after the replay).
void record_use_on_current_stream(const at::Tensor& t);

class StreamStamp {
 public:
  // The current stream of `t`'s device (nothing for CPU tensors).
  static StreamStamp current_for(const at::Tensor& t);
  // Makes `storage`, written on the stamped stream, safe to use on the
  // current one.
  void hand_over(const c10::Storage& storage) const;

 private:
  std::optional<c10::Stream> stream_;
};

} // namespace torch_sac::region
