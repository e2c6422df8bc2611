// kvevents-native: the index's stable content keys (see kvevents.consumers.content).
//
// One job: chain xxh3-64 over canonical units of little-endian signed 64-bit token ids,
// each unit's key seeded with the previous one.  Token ids are held as int64 in host
// order, which is the packed form on the little-endian machines this builds for.
#pragma once

#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvevents-native hashes int64 token ids in place: a little-endian target is required"
#endif

namespace kvn {

// The key of unit ``n_units - 1`` chained on ``k`` over ``tokens`` (``unit`` ids each).
inline uint64_t chain_units(uint64_t k, const int64_t* tokens, size_t n_units, size_t unit) {
  const size_t width = unit * sizeof(int64_t);
  for (size_t j = 0; j < n_units; ++j) k = XXH3_64bits_withSeed(tokens + j * unit, width, k);
  return k;
}

}  // namespace kvn
