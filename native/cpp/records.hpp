// kvevents-native: one KV-cache group's metadata records in a flat table
// (``GroupState.meta`` of kvevents/consumers/index/workers.py: engine hash -> record).
//
// One job: an insertion-ordered map from a 64-bit engine hash to a record of up to 192
// bits (the packed int of kvevents/consumers/index/records.py), laid out as CPython lays
// out a dict: an array of entries in insertion order (deleted ones blanked, compacted when
// they outnumber the live ones) and an open-addressing index of 32-bit entry numbers
// (linear probing, at most 2/3 full counting tombstones).  32 bytes an entry (the array
// grows by a quarter) and 6-12 of index, where a dict of Python ints takes about 140.  No Python here: module.cpp
// binds it as RecordTable, which hands a key or record that does not fit (bytes or
// negative hashes, wide tuple records) to a Python dict instead.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvn {

class RecordTable {
 public:
  static constexpr size_t kWords = 3;
  struct Entry {
    uint64_t key;
    uint64_t w[kWords];  // the record, little-endian words; all zero: deleted
    bool live() const { return (w[0] | w[1] | w[2]) != 0; }
  };

  // The record of ``key``, or null.
  const uint64_t* find(uint64_t key) const {
    const int64_t e = entry_of(key);
    return e < 0 ? nullptr : entries_[static_cast<size_t>(e)].w;
  }

  // Set the record of ``key`` (non-zero), keeping its place when present, else last.
  void set(uint64_t key, const uint64_t* w) {
    const int64_t e = entry_of(key);
    if (e >= 0) {
      std::copy_n(w, kWords, entries_[static_cast<size_t>(e)].w);
      return;
    }
    if ((used_ + 1) * 3 > index_.size() * 2) rebuild();
    const size_t mask = index_.size() - 1;
    size_t i = home(key);
    while (index_[i] >= 0) i = (i + 1) & mask;  // the first empty slot or tombstone
    if (index_[i] == kEmpty) ++used_;
    index_[i] = static_cast<int32_t>(entries_.size());
    if (entries_.size() == entries_.capacity())  // grown by a quarter: 36-40 B an entry
      entries_.reserve(entries_.size() + entries_.size() / 4 + 8);
    Entry ent{key, {w[0], w[1], w[2]}};
    entries_.push_back(ent);
    ++live_;
  }

  // Remove ``key``; false when absent.
  bool erase(uint64_t key) {
    const int64_t s = slot_of(key);
    if (s < 0) return false;
    Entry& ent = entries_[static_cast<size_t>(index_[static_cast<size_t>(s)])];
    std::fill_n(ent.w, kWords, 0);
    index_[static_cast<size_t>(s)] = kTombstone;
    --live_;
    if (live_ == 0) {
      clear();
    } else if (entries_.size() > 2 * live_ + 16) {
      rebuild();  // compact: the blanked entries go
    }
    return true;
  }

  void clear() {
    std::vector<Entry>().swap(entries_);
    std::vector<int32_t>().swap(index_);
    live_ = used_ = 0;
  }

  size_t size() const { return live_; }

  // Every live entry in insertion order.
  template <class F>
  void each(F&& f) const {
    for (const Entry& e : entries_)
      if (e.live()) f(e);
  }

  // Bytes held (entries and index, as allocated).
  size_t nbytes() const {
    return entries_.capacity() * sizeof(Entry) + index_.capacity() * sizeof(int32_t);
  }

 private:
  static constexpr int32_t kEmpty = -1;
  static constexpr int32_t kTombstone = -2;

  size_t home(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  // The index slot of ``key``, or -1.
  int64_t slot_of(uint64_t key) const {
    if (live_ == 0) return -1;
    const size_t mask = index_.size() - 1;
    for (size_t i = home(key);; i = (i + 1) & mask) {
      const int32_t e = index_[i];
      if (e == kEmpty) return -1;
      if (e >= 0 && entries_[static_cast<size_t>(e)].key == key) return static_cast<int64_t>(i);
    }
  }

  int64_t entry_of(uint64_t key) const {
    const int64_t s = slot_of(key);
    return s < 0 ? -1 : index_[static_cast<size_t>(s)];
  }

  // Compact the entries (in order) and re-index them in the least power of two that is
  // at most 2/3 full with one more entry.
  void rebuild() {
    const size_t want = live_ + 1;  // then at most 2/3 full: a slot holds 1.5-3 entries' worth
    std::vector<Entry> kept;
    kept.reserve(live_ + live_ / 4 + 8);
    for (const Entry& e : entries_)
      if (e.live()) kept.push_back(e);
    entries_.swap(kept);
    size_t cap = 8;
    while (cap * 2 < want * 3) cap *= 2;  // at most 2/3 full
    index_.assign(cap, kEmpty);
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(cap));
    const size_t mask = cap - 1;
    for (size_t n = 0; n < entries_.size(); ++n) {
      size_t i = home(entries_[n].key);
      while (index_[i] != kEmpty) i = (i + 1) & mask;
      index_[i] = static_cast<int32_t>(n);
    }
    used_ = entries_.size();
  }

  std::vector<Entry> entries_;
  std::vector<int32_t> index_;
  size_t live_ = 0;
  size_t used_ = 0;  // index slots not empty (entries and tombstones)
  unsigned shift_ = 61;
};

}  // namespace kvn

namespace kvn {

// An insertion-ordered set of 128-bit keys (two words), with the oldest taken first:
// the retained-records queue of kvevents/consumers/index/join.py (``Retention.records``,
// an OrderedDict of (worker, group, hash) -> None), the worker and group packed into the
// first word by the binding.  The same layout as RecordTable: 16-byte entries in
// insertion order (deleted ones marked, compacted when they outnumber the live ones, the
// oldest found from a cursor) and an open-addressing index of 32-bit entry numbers.
class KeyQueue {
 public:
  struct Entry {
    uint64_t a;  // kDead: deleted
    uint64_t b;
    bool live() const { return a != kDead; }
  };
  static constexpr uint64_t kDead = ~uint64_t{0};  // never a key's first word

  bool contains(uint64_t a, uint64_t b) const { return slot_of(a, b) >= 0; }

  // Add the key last; nothing when present (it keeps its place).
  void add(uint64_t a, uint64_t b) {
    if (slot_of(a, b) >= 0) return;
    if ((used_ + 1) * 3 > index_.size() * 2) rebuild();
    const size_t mask = index_.size() - 1;
    size_t i = home(a, b);
    while (index_[i] >= 0) i = (i + 1) & mask;
    if (index_[i] == kEmpty) ++used_;
    index_[i] = static_cast<int32_t>(entries_.size());
    if (entries_.size() == entries_.capacity())
      entries_.reserve(entries_.size() + entries_.size() / 4 + 8);
    entries_.push_back(Entry{a, b});
    ++live_;
  }

  bool remove(uint64_t a, uint64_t b) {
    const int64_t s = slot_of(a, b);
    if (s < 0) return false;
    drop(static_cast<size_t>(s));
    return true;
  }

  // Take the oldest key; false when empty.
  bool pop_first(uint64_t& a, uint64_t& b) {
    if (live_ == 0) return false;
    while (!entries_[head_].live()) ++head_;
    a = entries_[head_].a;
    b = entries_[head_].b;
    drop(static_cast<size_t>(slot_of(a, b)));
    return true;
  }

  void clear() {
    std::vector<Entry>().swap(entries_);
    std::vector<int32_t>().swap(index_);
    live_ = used_ = head_ = 0;
  }

  size_t size() const { return live_; }

  template <class F>
  void each(F&& f) const {
    for (size_t n = head_; n < entries_.size(); ++n)
      if (entries_[n].live()) f(entries_[n]);
  }

  size_t nbytes() const {
    return entries_.capacity() * sizeof(Entry) + index_.capacity() * sizeof(int32_t);
  }

 private:
  static constexpr int32_t kEmpty = -1;
  static constexpr int32_t kTombstone = -2;

  size_t home(uint64_t a, uint64_t b) const {
    return static_cast<size_t>(((a * 0xC2B2AE3D27D4EB4Full) ^ b) * 0x9E3779B97F4A7C15ull >> shift_);
  }

  int64_t slot_of(uint64_t a, uint64_t b) const {
    if (live_ == 0) return -1;
    const size_t mask = index_.size() - 1;
    for (size_t i = home(a, b);; i = (i + 1) & mask) {
      const int32_t e = index_[i];
      if (e == kEmpty) return -1;
      if (e >= 0 && entries_[static_cast<size_t>(e)].a == a && entries_[static_cast<size_t>(e)].b == b)
        return static_cast<int64_t>(i);
    }
  }

  void drop(size_t slot) {
    entries_[static_cast<size_t>(index_[slot])].a = kDead;
    index_[slot] = kTombstone;
    --live_;
    if (live_ == 0) {
      clear();
    } else if (entries_.size() > 2 * live_ + 16) {
      rebuild();
    }
  }

  void rebuild() {
    const size_t want = live_ + 1;  // then at most 2/3 full: a slot holds 1.5-3 entries' worth
    std::vector<Entry> kept;
    kept.reserve(live_ + live_ / 4 + 8);
    for (size_t n = head_; n < entries_.size(); ++n)
      if (entries_[n].live()) kept.push_back(entries_[n]);
    entries_.swap(kept);
    head_ = 0;
    size_t cap = 8;
    while (cap * 2 < want * 3) cap *= 2;
    index_.assign(cap, kEmpty);
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(cap));
    const size_t mask = cap - 1;
    for (size_t n = 0; n < entries_.size(); ++n) {
      size_t i = home(entries_[n].a, entries_[n].b);
      while (index_[i] != kEmpty) i = (i + 1) & mask;
      index_[i] = static_cast<int32_t>(n);
    }
    used_ = entries_.size();
  }

  std::vector<Entry> entries_;
  std::vector<int32_t> index_;
  size_t live_ = 0;
  size_t used_ = 0;
  size_t head_ = 0;  // no live entry before it
  unsigned shift_ = 61;
};

}  // namespace kvn
