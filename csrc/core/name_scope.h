#pragma once
// Named scopes: a thread-local stack of user-given names ("attn_out", "mlp")
// that policies can look at when deciding an op (policies::save_by_name).
//
// Names are interned once into small integer ids, so a scope costs a vector
// push and pop, and a policy decision is a few integer comparisons. Python
// reaches the stack through torch_sac.name(...); C++ users use NameScope.
//
// The stack is per thread and is not carried to other threads: a policy sees
// the scopes open on the thread that dispatched the op, which is the thread
// running the user's forward code.

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace torch_sac {

using NameId = int32_t;

// The id of `name`, the same for the same string for the life of the
// process. Raises ValueError for an empty name. Thread-safe.
NameId intern_name(std::string_view name);

// The string `id` was interned from. Raises IndexError for an unknown id.
std::string name_string(NameId id);

// The scopes open on this thread, outermost first.
c10::ArrayRef<NameId> active_names();

// Opens a scope on this thread; returns the stack depth after the push, the
// token that pop_name needs.
size_t push_name(NameId id);

// Closes the scope `push_name(id)` opened, given the depth it returned.
// Scopes close in reverse order of opening. Closing a scope that is not open
// at that depth raises RuntimeError (naming both scopes) and leaves the stack
// unchanged; closing a scope while scopes opened inside it are still open
// closes them all and then raises, naming the innermost.
void pop_name(NameId id, size_t depth);

// RAII scope for C++ code: `NameScope scope("attn_out");`.
class NameScope {
 public:
  explicit NameScope(std::string_view name);
  explicit NameScope(NameId id);
  ~NameScope();
  NameScope(const NameScope&) = delete;
  NameScope& operator=(const NameScope&) = delete;

 private:
  NameId id_;
  size_t depth_;
};

// Replaces this thread's stack with `names` until destroyed, then restores
// it. Used where the scopes of an op are known from elsewhere, e.g. from the
// FX node metadata torch.compile carries (see torch_sac/_torch_policy.py).
class NameStackOverride {
 public:
  explicit NameStackOverride(std::vector<NameId> names);
  ~NameStackOverride();
  NameStackOverride(const NameStackOverride&) = delete;
  NameStackOverride& operator=(const NameStackOverride&) = delete;

 private:
  std::vector<NameId> saved_;
};

} // namespace torch_sac
