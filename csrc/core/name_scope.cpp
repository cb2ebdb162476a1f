#include "csrc/core/name_scope.h"

#include <c10/util/Exception.h>

#include <deque>
#include <mutex>
#include <unordered_map>

namespace torch_sac {
namespace {

// Interned names. Never shrinks: ids stay valid for the life of the process.
struct NameRegistry {
  std::mutex mutex;
  std::unordered_map<std::string, NameId> ids;
  std::deque<std::string> names; // by id; deque keeps references stable
};

NameRegistry& registry() {
  static auto* r = new NameRegistry();
  return *r;
}

std::vector<NameId>& stack() {
  thread_local std::vector<NameId> names;
  return names;
}

std::string describe_top(const std::vector<NameId>& names, size_t depth) {
  if (names.size() < depth || depth == 0) {
    return "no open scope at that depth";
  }
  std::string out = "'";
  out += name_string(names[depth - 1]);
  out += "'";
  return out;
}

} // namespace

NameId intern_name(std::string_view name) {
  TORCH_CHECK_VALUE(!name.empty(), "torch_sac: a scope name must be a non-empty string");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto [it, inserted] = r.ids.try_emplace(std::string(name), static_cast<NameId>(r.names.size()));
  if (inserted) {
    r.names.emplace_back(name);
  }
  return it->second;
}

std::string name_string(NameId id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK_INDEX(
      id >= 0 && static_cast<size_t>(id) < r.names.size(), "torch_sac: unknown scope name id ", id);
  return r.names[id];
}

c10::ArrayRef<NameId> active_names() {
  return stack();
}

size_t push_name(NameId id) {
  auto& names = stack();
  names.push_back(id);
  return names.size();
}

void pop_name(NameId id, size_t depth) {
  auto& names = stack();
  TORCH_CHECK(
      depth >= 1 && names.size() >= depth && names[depth - 1] == id, "torch_sac: scope '",
      name_string(id), "' was closed out of order: at ", "its depth (", depth,
      ") the open scope is ", describe_top(names, depth),
      ". Scopes must close in reverse order of opening (use `with "
      "torch_sac.name(...):` rather than calling __enter__/__exit__ by hand, "
      "and do not keep a scope open across a generator's yield).");
  if (names.size() == depth) {
    names.pop_back();
    return;
  }
  // Scopes opened inside this one were never closed: drop them with it, so
  // the stack is right again, and report them.
  const std::string leaked = describe_top(names, names.size());
  names.resize(depth - 1);
  TORCH_CHECK(
      false, "torch_sac: scope '", name_string(id),
      "' was closed out of order: the "
      "scope ",
      leaked,
      " opened inside it is still open. Both are closed now. "
      "Scopes must close in reverse order of opening (use `with "
      "torch_sac.name(...):` rather than calling __enter__/__exit__ by hand, "
      "and do not keep a scope open across a generator's yield).");
}

NameScope::NameScope(std::string_view name) : NameScope(intern_name(name)) {}

NameScope::NameScope(NameId id) : id_(id), depth_(push_name(id)) {}

NameScope::~NameScope() {
  auto& names = stack();
  // Never throw from a destructor: restore what can be restored.
  if (names.size() >= depth_ && names[depth_ - 1] == id_) {
    names.resize(depth_ - 1);
  }
}

NameStackOverride::NameStackOverride(std::vector<NameId> names) : saved_(std::move(stack())) {
  stack() = std::move(names);
}

NameStackOverride::~NameStackOverride() {
  stack() = std::move(saved_);
}

} // namespace torch_sac
