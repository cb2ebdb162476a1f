#pragma once
// Typed indices into a region's tables, so that a storage index cannot be
// passed where an entry index is expected. Each is a 4-byte int32_t with no
// arithmetic: a plain value in registers and containers, hashed as an
// int32_t.
//
//   StorageId  a StorageRecord (storage_table.h), one per storage tracked
//   EntryId    a tape entry (tape.h), in recording order
//   ScopeId    a nested region (0: the region itself)
//   StateId    a storage's state: how many recorded writes it has had

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace torch_sac::region {

template <class Tag>
struct Id {
  int32_t value = -1;

  constexpr Id() = default;
  constexpr explicit Id(int32_t v) : value(v) {}
  // From a table's size or position.
  static constexpr Id at(size_t index) {
    return Id(static_cast<int32_t>(index));
  }
  static constexpr Id invalid() {
    return Id();
  }
  constexpr bool valid() const {
    return value >= 0;
  }
  constexpr size_t index() const {
    return static_cast<size_t>(value);
  }
  // The next one: the entry recorded after this one, the state after one
  // more write.
  constexpr Id next() const {
    return Id(value + 1);
  }
  friend constexpr bool operator==(Id, Id) = default;
  friend constexpr auto operator<=>(Id, Id) = default;
};

using StorageId = Id<struct StorageTag>;
using EntryId = Id<struct EntryTag>;
using ScopeId = Id<struct ScopeTag>;
using StateId = Id<struct StateTag>;

static_assert(sizeof(StorageId) == sizeof(int32_t));

// A table indexed by one kind of id (and only by it).
template <class IdT, class T>
class IdVector : public std::vector<T> {
 public:
  using std::vector<T>::vector;
  T& operator[](IdT id) {
    return std::vector<T>::operator[](id.index());
  }
  const T& operator[](IdT id) const {
    return std::vector<T>::operator[](id.index());
  }
  T& at(IdT id) {
    return std::vector<T>::at(id.index());
  }
  const T& at(IdT id) const {
    return std::vector<T>::at(id.index());
  }
  // The id the next element pushed gets.
  IdT next_id() const {
    return IdT::at(this->size());
  }
};

} // namespace torch_sac::region

template <class Tag>
struct std::hash<torch_sac::region::Id<Tag>> {
  size_t operator()(torch_sac::region::Id<Tag> id) const noexcept {
    return std::hash<int32_t>{}(id.value);
  }
};
