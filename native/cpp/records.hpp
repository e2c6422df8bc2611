// kvevents-native: the index's flat tables keyed by engine hash.
//
// One job: insertion-ordered tables laid out as CPython lays out a dict (an array of
// entries in insertion order, deleted ones marked and compacted away, and an
// open-addressing index of 32-bit entry numbers; ``OrderedEntries``), for two of the
// index's containers: ``RecordTable``, a group's records (``GroupState.meta``: engine hash
// -> the packed record of kvevents/consumers/index/records.py, up to 192 bits; 32 bytes an
// entry, the array grown by a quarter, and 6-12 of index, where a dict of Python ints
// takes about 140), and ``KeyQueue``, the retained records' order.  No Python here:
// module.cpp binds them as RecordTable and RetainedQueue, which hand a key or value that
// does not fit (bytes or negative hashes, wide tuple records) to a Python container.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvn {

// Entries in insertion order and an open-addressing index of their numbers, as CPython
// lays out a dict: linear probing, a power-of-two index at most 2/3 full counting
// tombstones, deleted entries marked and compacted away once they outnumber the live
// ones, the oldest live entry found from a cursor.  The layout both tables below share.
// ``Entry`` gives its ``Key``, ``id()`` (its key), ``hash(key)`` (mixed again here), ``live()``
// and ``kill()`` (mark it deleted).
template <class Entry>
class OrderedEntries {
 public:
  using Key = typename Entry::Key;

  Entry* find(const Key& k) {
    const int64_t s = slot_of(k);
    return s < 0 ? nullptr : &entries_[static_cast<size_t>(index_[static_cast<size_t>(s)])];
  }
  const Entry* find(const Key& k) const { return const_cast<OrderedEntries*>(this)->find(k); }

  // Add ``e`` last; its key must be absent.
  void append(const Entry& e) {
    if ((used_ + 1) * 3 > index_.size() * 2) rebuild();
    const size_t mask = index_.size() - 1;
    size_t i = home(e.id());
    while (index_[i] >= 0) i = (i + 1) & mask;  // the first empty slot or tombstone
    if (index_[i] == kEmpty) ++used_;
    index_[i] = static_cast<int32_t>(entries_.size());
    if (entries_.size() == entries_.capacity())  // grown by a quarter, not doubled
      entries_.reserve(entries_.size() + entries_.size() / 4 + 8);
    entries_.push_back(e);
    ++live_;
  }

  // Remove the entry of ``k``; false when absent.
  bool erase(const Key& k) {
    const int64_t s = slot_of(k);
    if (s < 0) return false;
    entries_[static_cast<size_t>(index_[static_cast<size_t>(s)])].kill();
    index_[static_cast<size_t>(s)] = kTombstone;
    --live_;
    if (live_ == 0) {
      clear();
    } else if (entries_.size() > 2 * live_ + 16) {
      rebuild();  // compact: the deleted entries go
    }
    return true;
  }

  // Take the oldest entry out; false when empty.
  bool pop_first(Entry& out) {
    if (live_ == 0) return false;
    while (!entries_[head_].live()) ++head_;
    out = entries_[head_];
    erase(out.id());
    return true;
  }

  void clear() {
    std::vector<Entry>().swap(entries_);
    std::vector<int32_t>().swap(index_);
    live_ = used_ = head_ = 0;
  }

  size_t size() const { return live_; }

  // Every live entry in insertion order.
  template <class F>
  void each(F&& f) const {
    for (size_t n = head_; n < entries_.size(); ++n)
      if (entries_[n].live()) f(entries_[n]);
  }

  // Bytes held (entries and index, as allocated).
  size_t nbytes() const {
    return entries_.capacity() * sizeof(Entry) + index_.capacity() * sizeof(int32_t);
  }

 private:
  static constexpr int32_t kEmpty = -1;
  static constexpr int32_t kTombstone = -2;

  size_t home(const Key& k) const {
    return static_cast<size_t>((Entry::hash(k) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  // The index slot of ``k``, or -1.
  int64_t slot_of(const Key& k) const {
    if (live_ == 0) return -1;
    const size_t mask = index_.size() - 1;
    for (size_t i = home(k);; i = (i + 1) & mask) {
      const int32_t e = index_[i];
      if (e == kEmpty) return -1;
      if (e >= 0 && entries_[static_cast<size_t>(e)].id() == k) return static_cast<int64_t>(i);
    }
  }

  // Compact the entries (in order) and re-index them in the least power of two that is
  // at most 2/3 full with one more entry (1.5-3 index slots an entry).
  void rebuild() {
    const size_t want = live_ + 1;
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
      size_t i = home(entries_[n].id());
      while (index_[i] != kEmpty) i = (i + 1) & mask;
      index_[i] = static_cast<int32_t>(n);
    }
    used_ = entries_.size();
  }

  std::vector<Entry> entries_;
  std::vector<int32_t> index_;
  size_t live_ = 0;
  size_t used_ = 0;  // index slots not empty (entries and tombstones)
  size_t head_ = 0;  // no live entry before it
  unsigned shift_ = 61;
};

// One KV-cache group's records: engine hash -> a record of up to 192 bits (32-byte
// entries).
class RecordTable {
 public:
  static constexpr size_t kWords = 3;
  struct Entry {
    using Key = uint64_t;
    uint64_t key;
    uint64_t w[kWords];  // the record, little-endian words; all zero: deleted
    Key id() const { return key; }
    static uint64_t hash(Key k) { return k; }
    bool live() const { return (w[0] | w[1] | w[2]) != 0; }
    void kill() { std::fill_n(w, kWords, 0); }
  };

  // The record of ``key``, or null.
  const uint64_t* find(uint64_t key) const {
    const Entry* e = t_.find(key);
    return e ? e->w : nullptr;
  }

  // Set the record of ``key`` (non-zero), keeping its place when present, else last.
  void set(uint64_t key, const uint64_t* w) {
    if (Entry* e = t_.find(key)) {
      std::copy_n(w, kWords, e->w);
    } else {
      t_.append(Entry{key, {w[0], w[1], w[2]}});
    }
  }

  bool erase(uint64_t key) { return t_.erase(key); }
  void clear() { t_.clear(); }
  size_t size() const { return t_.size(); }
  template <class F>
  void each(F&& f) const { t_.each(std::forward<F>(f)); }
  size_t nbytes() const { return t_.nbytes(); }

 private:
  OrderedEntries<Entry> t_;
};

// The retained-records queue of kvevents/consumers/index/join.py (``Retention.records``,
// an OrderedDict of (worker, group, hash) -> None) as 128-bit keys, the worker and group
// packed into the first word by the binding (16-byte entries), the oldest taken first.
class KeyQueue {
 public:
  struct Entry {
    using Key = std::pair<uint64_t, uint64_t>;
    uint64_t a;  // kDead: deleted
    uint64_t b;
    Key id() const { return {a, b}; }
    static uint64_t hash(const Key& k) { return (k.first * 0xC2B2AE3D27D4EB4Full) ^ k.second; }
    bool live() const { return a != kDead; }
    void kill() { a = kDead; }
  };
  static constexpr uint64_t kDead = ~uint64_t{0};  // never a key's first word

  bool contains(uint64_t a, uint64_t b) const { return t_.find({a, b}) != nullptr; }

  // Add the key last; nothing when present (it keeps its place).
  void add(uint64_t a, uint64_t b) {
    if (!t_.find({a, b})) t_.append(Entry{a, b});
  }

  bool remove(uint64_t a, uint64_t b) { return t_.erase({a, b}); }

  // Take the oldest key; false when empty.
  bool pop_first(uint64_t& a, uint64_t& b) {
    Entry e{0, 0};
    if (!t_.pop_first(e)) return false;
    a = e.a;
    b = e.b;
    return true;
  }

  void clear() { t_.clear(); }
  size_t size() const { return t_.size(); }
  template <class F>
  void each(F&& f) const { t_.each(std::forward<F>(f)); }
  size_t nbytes() const { return t_.nbytes(); }

 private:
  OrderedEntries<Entry> t_;
};

}  // namespace kvn
