// kvevents-native: the per-worker lookup by vLLM's rules, compiled
// (kvevents.consumers.router.lookup.WorkerLookup, for plans without lookahead).
//
// One job: for one request (its unit content keys, its length, the full-attention
// prefix walk's answer), each plan's (gpu, cpu, storage) exactly as WorkerLookup.match
// computes it: gpu_hit (the coordinators' find_longest_cache_hit, full-attention,
// sliding-window and chunked-local groups, EAGLE's drop), chunk_hit (the offload
// connector's _lookup_complete_chunks), run and last_run, step for step.  The Python
// class is the specification; this one reads the tiers' SlotMarks directly (one table
// probe per key and tier, on first use) instead of a Python int per key.  No Python
// here: module.cpp binds it as Lookups.
//
// Divisions and remainders are Python's (floor), so every expression means what the
// Python one does.  The plans are checked when bound (positive block sizes, windows,
// alignment; spec groups with at least one slot); the unit is checked per call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "marks.hpp"

namespace kvn {

inline int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
inline int64_t floormod(int64_t a, int64_t b) { return a - floordiv(a, b) * b; }

enum class GroupCls : uint8_t { Full, Local, Sliding };

// layout.SpecGroup: groups judged together; a block is held when every slot holds it
struct SpecGroup {
  GroupCls cls;
  int64_t block_size;
  int64_t window;
  std::vector<uint32_t> slots;
};

// one entry of LookupPlan.chunk_groups: (cls, block size, window in chunks, slot bit)
struct ChunkGroup {
  bool full;
  int64_t block_size;
  int64_t wchunks;
  std::vector<uint32_t> slots;
};

// layout.LookupPlan without lookahead (``lookahead`` 0) and not blocked
struct Plan {
  bool unitary = false;
  std::vector<SpecGroup> spec_groups;
  int64_t align = 1;
  std::vector<ChunkGroup> chunk_groups;
  bool windowed = false;
  int64_t bpc = 0;
  bool eagle = false;
};

struct Hit {
  int64_t gpu, cpu, storage;
};

// One request looked up on plans one at a time (WorkerLookup with ``lookahead`` 0).
class Lookup {
 public:
  // ``marks``: the three tiers; ``keys``: the request's unit keys (``unit`` tokens
  // each) of its ``n`` tokens; ``prefix`` (``nprefix`` entries, or null for none): by
  // slot + 1, full_prefix's answer.
  Lookup(const SlotMarks* const marks[3], const uint64_t* keys, size_t nkeys, int64_t n,
         int64_t unit, const int64_t* prefix, size_t nprefix)
      : keys_(keys), nkeys_(static_cast<int64_t>(nkeys)), n_(n), unit_(unit),
        prefix_(prefix), nprefix_(nprefix) {
    if (unit <= 0) throw std::invalid_argument("Lookup: unit must be positive");
    for (int t = 0; t < 3; ++t) marks_[t] = marks[t];
  }

  Hit match(const Plan& p) {
    const int64_t gpu = gpu_hit(p);
    if (!p.bpc) return Hit{gpu, 0, 0};
    const int64_t cpu = marks_[1]->size() ? chunk_hit(p, gpu, 1) : 0;
    const int64_t storage = marks_[2]->size() ? chunk_hit(p, gpu + cpu, 2) : 0;
    return Hit{gpu, cpu, storage};
  }

 private:
  // every slot of ``slots`` holds key ``idx`` on ``tier`` (the Python ``v & bits == bits``)
  bool held(int tier, int64_t idx, const std::vector<uint32_t>& slots) {
    std::vector<SlotMarks::View>& row = rows_[tier];
    std::vector<char>& seen = seen_[tier];
    if (row.empty()) {
      row.resize(static_cast<size_t>(nkeys_));
      seen.assign(static_cast<size_t>(nkeys_), 0);
    }
    const size_t i = static_cast<size_t>(idx);
    if (!seen[i]) {
      row[i] = marks_[tier]->view(keys_[i]);
      seen[i] = 1;
    }
    const SlotMarks::View& v = row[i];
    for (uint32_t s : slots)
      if (!v.has(s)) return false;
    return true;
  }

  int64_t step_of(int64_t span) const {
    const int64_t step = floordiv(span, unit_);
    if (step <= 0) throw std::invalid_argument("Lookup: a block or chunk shorter than a unit");
    return step;
  }

  // WorkerLookup.run
  int64_t run(int tier, const std::vector<uint32_t>& slots, int64_t size, int64_t first,
              int64_t stop, int64_t span) {
    const int64_t step = step_of(span ? span : size);
    stop = std::min(stop, floordiv(nkeys_, step));
    int64_t i = first;
    int64_t idx = (first + 1) * step - 1;
    while (i < stop && held(tier, idx, slots)) {
      ++i;
      idx += step;
    }
    return i - first;
  }

  // WorkerLookup.last_run (``tail_`` as its ``self.tail``)
  int64_t last_run(int tier, const std::vector<uint32_t>& slots, int64_t size, int64_t first,
                   int64_t stop, int64_t need, int64_t align, int64_t span) {
    span = span ? span : size;
    const int64_t step = step_of(span);
    stop = std::min(stop, floordiv(nkeys_, step));
    int64_t run = 0;
    int64_t i = stop - 1;
    int64_t idx = stop * step - 1;
    while (i >= first) {
      if (held(tier, idx, slots)) {
        if (run || span == align || floormod((i + 1) * span, align) == 0) {
          ++run;
          if (run >= need) {
            tail_ = run;
            return i + run;
          }
        }
      } else {
        run = 0;
      }
      --i;
      idx -= step;
    }
    tail_ = run;
    return -1;
  }

  int64_t prefix_at(uint32_t slot) const {
    const size_t p = static_cast<size_t>(slot) + 1;
    if (p >= nprefix_) throw std::out_of_range("Lookup: a full-attention slot past the prefix");
    return prefix_[p];
  }

  // WorkerLookup.gpu_hit
  int64_t gpu_hit(const Plan& p) {
    const int64_t cap = n_ - 1;  // the last prompt token is always recomputed
    const std::vector<SpecGroup>& groups = p.spec_groups;
    if (p.unitary) {
      const SpecGroup& sg = groups[0];
      return find(sg, cap, sg.block_size, p.eagle);
    }
    const int64_t align = p.align;
    int64_t hit = cap;
    const size_t ng = groups.size();
    found_.assign(ng, 0);
    has_found_.assign(ng, 0);
    verified_.assign(ng, 0);
    const bool simple_hybrid = ng == 2 && groups[0].cls == GroupCls::Full;
    for (;;) {
      int64_t curr = hit;
      for (size_t i = 0; i < ng; ++i) {
        const SpecGroup& sg = groups[i];
        if (sg.cls == GroupCls::Full && has_found_[i]) {
          curr = std::min(curr, found_[i]);  // full attention is downward-closed
          continue;
        }
        const bool drop = p.eagle && !verified_[i];
        const int64_t max_len = drop ? std::min(curr + sg.block_size, cap) : curr;
        const int64_t got = find(sg, max_len, align, drop);
        if (drop) {
          verified_[i] = 1;
        } else if (got < curr) {
          std::fill(verified_.begin(), verified_.end(), 0);
        }
        curr = got;
        if (sg.cls == GroupCls::Full) {
          found_[i] = got;
          has_found_[i] = 1;
        }
      }
      if (curr >= hit) break;
      hit = curr;
      if (simple_hybrid) break;
    }
    return hit;
  }

  // WorkerLookup.find
  int64_t find(const SpecGroup& sg, int64_t max_len, int64_t align, bool drop) {
    const int64_t size = sg.block_size;
    const int64_t nb = max_len > 0 ? floordiv(max_len, size) : 0;
    if (sg.cls == GroupCls::Full) {
      int64_t c;
      if (prefix_) {
        int64_t least = std::numeric_limits<int64_t>::max();
        for (uint32_t s : sg.slots) least = std::min(least, prefix_at(s));
        c = std::min(nb, floordiv(least, size));
      } else {
        c = run(0, sg.slots, size, 0, nb, 0);
      }
      if (drop && c) c -= 1;
      while (size != align && floormod(c * size, align)) c -= 1;
      return c * size;
    }
    if (sg.cls == GroupCls::Local) {
      // blocks before the attention chunk holding max_len are outside every window
      const int64_t first =
          floordiv(max_len > 0 ? floordiv(max_len, sg.window) * sg.window : 0, size);
      return (first + run(0, sg.slots, size, first, nb, 0)) * size;
    }
    // sliding window: the window's blocks at the hit end, searched from the right
    const int64_t need = std::max<int64_t>(1, -floordiv(-(sg.window - 1), size) + (drop ? 1 : 0));
    int64_t hit = last_run(0, sg.slots, size, 0, nb, need, align, 0);
    if (hit < 0) {
      hit = tail_;  // the run reaching block 0, if it started on an aligned end
      while (size != align && floormod(hit * size, align)) hit -= 1;
    }
    if (drop && hit) hit -= 1;
    return hit * size;
  }

  // WorkerLookup.chunk_hit
  int64_t chunk_hit(const Plan& p, int64_t base, int tier) {
    const int64_t n = n_;
    int64_t bound = p.windowed ? n - 1 : n;
    const int64_t hashed = n;  // (no lookahead)
    bool eagle = p.eagle;
    std::vector<const ChunkGroup*> groups;
    for (const ChunkGroup& g : p.chunk_groups) groups.push_back(&g);
    std::vector<const ChunkGroup*> todo;
    int64_t hit = 0;
    while (!groups.empty()) {
      todo.swap(groups);
      groups.clear();
      bool windowed = false;  // a windowed group was looked up in this pass
      for (const ChunkGroup* g : todo) {
        int64_t wchunks = g->wchunks;
        const int64_t tpc = p.bpc * g->block_size;
        const int64_t nkeys = hashed > 0 ? floordiv(hashed, tpc) : 0;
        bound = std::min(bound, nkeys * tpc);
        if (bound - base < tpc) return 0;
        int64_t query = bound;
        if (eagle && !g->full) {
          // an EAGLE window group looks one chunk further, then drops it
          query = std::min(bound + tpc, nkeys * tpc);
          wchunks += 1;
        }
        const int64_t nb = std::min(-floordiv(-query, tpc), nkeys);
        const int64_t start = floordiv(base, tpc);
        int64_t hits;
        if (g->full) {
          hits = run(tier, g->slots, g->block_size, start, nb, tpc);
        } else {
          const int64_t end = last_run(tier, g->slots, g->block_size, start, nb, wchunks, tpc, tpc);
          hits = end >= 0 ? end - start : tail_;
        }
        if (hits <= 0) return 0;
        if (eagle) hits -= 1;  // EAGLE drops the last hit chunk
        bound = std::min(bound, tpc * (start + hits));
        const int64_t got = bound - base;
        if (got < tpc) return 0;
        if (got < hit && windowed && groups.empty()) {
          // a window found earlier may stick out past the new bound
          for (const ChunkGroup& w : p.chunk_groups)
            if (!w.full) groups.push_back(&w);
        }
        windowed = windowed || !g->full;
        hit = got;
      }
      // every group is an EAGLE group and each dropped its chunk once: the checks
      // again neither look further nor drop
      eagle = false;
    }
    return hit;
  }

  const SlotMarks* marks_[3];
  const uint64_t* keys_;
  int64_t nkeys_;
  int64_t n_;
  int64_t unit_;
  const int64_t* prefix_;
  size_t nprefix_;
  int64_t tail_ = 0;
  std::vector<SlotMarks::View> rows_[3];
  std::vector<char> seen_[3];
  std::vector<int64_t> found_;
  std::vector<char> has_found_, verified_;
};

}  // namespace kvn
