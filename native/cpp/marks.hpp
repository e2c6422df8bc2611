// kvevents-native: a tier's marks in flat tables (kvevents.consumers.index.marks.TierMarks).
//
// One job: content key -> the slots holding it, counted per (key, slot), with the same
// writers (mark, unmark) and answers as the Python TierMarks, which is its
// specification.  No Python here: module.cpp binds it as SlotMarks.
//
// Layout.  An open-addressing table (linear probing, power-of-two capacity, at most 3/4
// full, backward-shift deletion: no tombstones) of 24-byte entries: the key, the order in
// which it was marked (``seq``, the Python dict's insertion order, which the snapshot
// keeps), and its holders: one slot inline, or the index of a bitset of 64-bit words
// when several slots hold it.  References beyond the first per (key, slot) are counted
// in a side map (rare: two engine blocks of one slot with one content key).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvn {

class SlotMarks {
 public:
  using Words = std::vector<uint64_t>;

  // One more reference of ``key`` by ``slot``.
  void mark(uint64_t key, uint32_t slot) {
    size_t i = find(key);
    if (i == kNone) {
      grow_if_full();
      i = insert_at(key);
      table_[i].one = slot;
      table_[i].set = kInline;
      return;
    }
    Entry& e = table_[i];
    if (e.set == kInline) {
      if (e.one == slot) return add_dup(key, slot);
      const uint32_t s = alloc_set();
      set_bit(sets_[s], e.one);
      set_bit(sets_[s], slot);
      e.set = s;
      return;
    }
    Words& w = sets_[e.set];
    if (has_bit(w, slot)) return add_dup(key, slot);
    set_bit(w, slot);
  }

  // One reference of ``key`` by ``slot`` fewer: an extra one if counted, else the
  // slot's bit (and the key with its last holder).  Nothing when ``slot`` does not hold it.
  void unmark(uint64_t key, uint32_t slot) {
    if (!dups_.empty()) {
      auto it = dups_.find(DupKey{key, slot});
      if (it != dups_.end()) {
        if (--it->second.count == 0) dups_.erase(it);
        return;
      }
    }
    const size_t i = find(key);
    if (i == kNone) return;
    Entry& e = table_[i];
    if (e.set == kInline) {
      if (e.one == slot) erase_at(i);
      return;
    }
    Words& w = sets_[e.set];
    if (!has_bit(w, slot)) return;
    w[slot / 64] &= ~(uint64_t{1} << (slot % 64));
    uint32_t left = 0, only = 0;
    for (size_t j = 0; j < w.size() && left < 2; ++j) {
      uint64_t x = w[j];
      while (x && left < 2) {
        only = static_cast<uint32_t>(j * 64 + static_cast<size_t>(__builtin_ctzll(x)));
        x &= x - 1;
        ++left;
      }
    }
    if (left == 1) {  // one holder left: back inline
      free_set(e.set);
      e.set = kInline;
      e.one = only;
    } else if (left == 0) {  // (not reached: a set holds two slots or more)
      free_set(e.set);
      erase_at(i);
    }
  }

  // The holders of ``key`` as ``words`` 64-bit words (bits beyond them dropped); false
  // (and zeros) when nobody holds it.
  bool read(uint64_t key, size_t words, uint64_t* out) const {
    std::fill(out, out + words, 0);
    const size_t i = find(key);
    if (i == kNone) return false;
    const Entry& e = table_[i];
    if (e.set == kInline) {
      if (e.one / 64 < words) out[e.one / 64] = uint64_t{1} << (e.one % 64);
    } else {
      const Words& w = sets_[e.set];
      std::copy_n(w.begin(), std::min(words, w.size()), out);
    }
    return true;
  }

  // The holders of ``key`` trimmed to the highest set word (empty: nobody).
  Words holders(uint64_t key) const {
    Words out;
    const size_t i = find(key);
    if (i == kNone) return out;
    const Entry& e = table_[i];
    if (e.set == kInline) {
      set_bit(out, e.one);
    } else {
      out = sets_[e.set];
      while (!out.empty() && out.back() == 0) out.pop_back();
    }
    return out;
  }

  // A read-only view of one key's holders, valid until the table is next written.
  struct View {
    const uint64_t* words = nullptr;  // the bitset (when not ``single``)
    size_t nwords = 0;
    uint32_t one = 0;     // the one holder (when ``single``)
    bool single = false;
    bool present = false;  // someone holds the key
    bool has(uint32_t slot) const {
      if (!present) return false;
      if (single) return slot == one;
      return slot / 64 < nwords && (words[slot / 64] >> (slot % 64) & 1);
    }
  };
  View view(uint64_t key) const {
    View v;
    const size_t i = find(key);
    if (i == kNone) return v;
    const Entry& e = table_[i];
    v.present = true;
    if (e.set == kInline) {
      v.single = true;
      v.one = e.one;
    } else {
      v.words = sets_[e.set].data();
      v.nwords = sets_[e.set].size();
    }
    return v;
  }

  bool contains(uint64_t key) const { return find(key) != kNone; }
  size_t size() const { return size_; }

  // Every key in the order it was first marked (since it was last unmarked whole).
  std::vector<uint64_t> keys_in_order() const {
    std::vector<std::pair<uint64_t, uint64_t>> by_seq;
    by_seq.reserve(size_);
    for (const Entry& e : table_)
      if (e.seq) by_seq.emplace_back(e.seq, e.key);
    std::sort(by_seq.begin(), by_seq.end());
    std::vector<uint64_t> out;
    out.reserve(by_seq.size());
    for (auto& p : by_seq) out.push_back(p.second);
    return out;
  }

  struct Dup {
    uint64_t key;
    uint32_t slot;
    uint32_t count;
  };
  // The extra references, in the order each (key, slot) was first counted.
  std::vector<Dup> dups_in_order() const {
    std::vector<std::pair<uint64_t, Dup>> by_seq;
    for (auto& [k, v] : dups_) by_seq.push_back({v.seq, Dup{k.key, k.slot, v.count}});
    std::sort(by_seq.begin(), by_seq.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<Dup> out;
    for (auto& p : by_seq) out.push_back(p.second);
    return out;
  }

  // Set ``key``'s holders to exactly the set bits of ``w`` (a restore; none: removed).
  void load(uint64_t key, const Words& w) {
    size_t i = find(key);
    if (i != kNone) {
      if (table_[i].set != kInline) free_set(table_[i].set);
      erase_at(i);
    }
    for (size_t j = 0; j < w.size(); ++j) {
      uint64_t x = w[j];
      while (x) {
        mark(key, static_cast<uint32_t>(j * 64 + static_cast<size_t>(__builtin_ctzll(x))));
        x &= x - 1;
      }
    }
  }

  // ``count`` extra references of ``key`` by ``slot`` (a restore).
  void load_dup(uint64_t key, uint32_t slot, uint32_t count) {
    if (count == 0) return;
    auto [it, fresh] = dups_.try_emplace(DupKey{key, slot}, DupCount{0, 0});
    if (fresh) it->second.seq = ++seq_;
    it->second.count += count;
  }

  size_t dup_count() const { return dups_.size(); }

  // Bytes held by the tables (the entries, the bitsets, the counted extras).
  size_t nbytes() const {
    size_t n = table_.capacity() * sizeof(Entry);
    for (const Words& w : sets_) n += sizeof(Words) + w.capacity() * sizeof(uint64_t);
    n += free_sets_.capacity() * sizeof(uint32_t);
    n += dups_.size() * (sizeof(DupKey) + sizeof(DupCount) + 2 * sizeof(void*));
    return n;
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  static constexpr uint32_t kInline = 0xFFFFFFFFu;

  struct Entry {
    uint64_t key;
    uint64_t seq;  // 0: empty
    uint32_t one;  // the one holder (set == kInline)
    uint32_t set;  // index into sets_, or kInline
  };
  struct DupKey {
    uint64_t key;
    uint32_t slot;
    bool operator==(const DupKey& o) const { return key == o.key && slot == o.slot; }
  };
  struct DupHash {
    size_t operator()(const DupKey& k) const {
      return static_cast<size_t>(k.key * 0x9E3779B97F4A7C15ull ^ k.slot);
    }
  };
  struct DupCount {
    uint32_t count;
    uint64_t seq;
  };

  static void set_bit(Words& w, uint32_t slot) {
    if (w.size() <= slot / 64) w.resize(slot / 64 + 1, 0);
    w[slot / 64] |= uint64_t{1} << (slot % 64);
  }
  static bool has_bit(const Words& w, uint32_t slot) {
    return slot / 64 < w.size() && (w[slot / 64] >> (slot % 64) & 1);
  }

  size_t home(uint64_t key) const {
    // Fibonacci hashing: content keys are already well mixed; this guards the rest
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  size_t find(uint64_t key) const {
    if (size_ == 0) return kNone;
    const size_t mask = table_.size() - 1;
    for (size_t i = home(key);; i = (i + 1) & mask) {
      const Entry& e = table_[i];
      if (!e.seq) return kNone;
      if (e.key == key) return i;
    }
  }

  // Place a new key (known absent; the table has room).
  size_t insert_at(uint64_t key) {
    const size_t mask = table_.size() - 1;
    size_t i = home(key);
    while (table_[i].seq) i = (i + 1) & mask;
    table_[i].key = key;
    table_[i].seq = ++seq_;
    ++size_;
    return i;
  }

  // Remove entry ``i``, shifting later entries of its probe run back (no tombstones).
  void erase_at(size_t i) {
    const size_t mask = table_.size() - 1;
    size_t j = i;
    for (;;) {
      j = (j + 1) & mask;
      if (!table_[j].seq) break;
      const size_t h = home(table_[j].key);
      // entry j may move to the hole at i when its home is not in (i, j] cyclically
      const bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        table_[i] = table_[j];
        i = j;
      }
    }
    table_[i] = Entry{0, 0, 0, kInline};
    --size_;
    if (table_.size() > kMinCapacity && size_ * 8 < table_.size()) rehash(table_.size() / 2);
  }

  void grow_if_full() {
    if (table_.empty()) {
      rehash(kMinCapacity);
    } else if ((size_ + 1) * 4 > table_.size() * 3) {
      rehash(table_.size() * 2);
    }
  }

  void rehash(size_t capacity) {
    std::vector<Entry> old;
    old.swap(table_);
    table_.assign(capacity, Entry{0, 0, 0, kInline});
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    const size_t mask = capacity - 1;
    for (const Entry& e : old) {
      if (!e.seq) continue;
      size_t i = home(e.key);
      while (table_[i].seq) i = (i + 1) & mask;
      table_[i] = e;
    }
  }

  uint32_t alloc_set() {
    if (!free_sets_.empty()) {
      uint32_t s = free_sets_.back();
      free_sets_.pop_back();
      return s;
    }
    sets_.emplace_back();
    return static_cast<uint32_t>(sets_.size() - 1);
  }
  void free_set(uint32_t s) {
    Words().swap(sets_[s]);
    free_sets_.push_back(s);
  }

  void add_dup(uint64_t key, uint32_t slot) {
    auto [it, fresh] = dups_.try_emplace(DupKey{key, slot}, DupCount{0, 0});
    if (fresh) it->second.seq = ++seq_;
    ++it->second.count;
  }

  static constexpr size_t kMinCapacity = 16;
  std::vector<Entry> table_;
  unsigned shift_ = 60;
  size_t size_ = 0;
  uint64_t seq_ = 0;
  std::vector<Words> sets_;
  std::vector<uint32_t> free_sets_;
  std::unordered_map<DupKey, DupCount, DupHash> dups_;
};

}  // namespace kvn
