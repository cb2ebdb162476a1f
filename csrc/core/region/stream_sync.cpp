#include "csrc/core/region/stream_sync.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace torch_sac::region {

StreamStamp StreamStamp::current_for(const at::Tensor& t) {
  StreamStamp stamp;
  if (t.defined() && !t.device().is_cpu() && !t.device().is_meta()) {
    const c10::impl::VirtualGuardImpl impl(t.device().type());
    stamp.stream_ = impl.getStream(t.device());
  }
  return stamp;
}

void record_use_on_current_stream(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.device().is_cpu() || t.device().is_meta()) {
    return;
  }
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(t.device()));
}

void StreamStamp::hand_over(const c10::Storage& storage) const {
  if (!stream_) {
    return;
  }
  const c10::impl::VirtualGuardImpl impl(stream_->device_type());
  const c10::Stream now = impl.getStream(stream_->device());
  if (now == *stream_) {
    return;
  }
  c10::Event produced(stream_->device_type());
  produced.record(*stream_);
  produced.block(now);
  impl.recordDataPtrOnStream(storage.data_ptr(), now);
}

} // namespace torch_sac::region
