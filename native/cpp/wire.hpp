// kvevents-native: a bounded reader of vLLM's KV-event msgpack wire.
//
// One job: turn one payload frame into a flat Batch (events, hashes and token ids in
// arrays, strings and nested values as spans of the payload) without touching Python.
// The reader is deliberately conservative: it accepts only the shapes that the typed
// decoders of kvevents.codec.decode.BatchDecoder read the same way (map-form events with
// the "type" key first, array-form events of the lengths vLLM wrote, int or bin hashes,
// no duplicate keys, valid UTF-8, no trailing bytes).  Anything else, malformed input
// included, is Result::Fallback: the caller hands the payload to the Python decoder,
// which either reads it tolerantly or raises its DecodeError.  No input makes it read
// outside the payload, allocate more than a constant times the payload size, or recurse
// deeper than kMaxDepth.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace kvn {

struct Span {
  uint32_t off = 0;
  uint32_t len = 0;
};

enum class Kind : uint8_t { Stored = 0, Removed = 1, Cleared = 2 };

// A block hash as it travels: an unsigned int, a negative int64, or raw digest bytes.
enum class HashTag : uint8_t { Unsigned = 0, Negative = 1, Bytes = 2 };

struct Hash {
  uint64_t v = 0;  // the value (two's complement bits for Negative)
  HashTag tag = HashTag::Unsigned;
  Span bytes;
};

struct OptInt {
  int64_t v = 0;
  bool has = false;
};

struct OptStr {
  Span s;
  bool has = false;
};

// Field ids, in vLLM 0.33's BlockStored order; BlockRemoved uses a subset.
enum Field : int {
  F_HASHES = 0,
  F_PARENT,
  F_TOKENS,
  F_BLOCK_SIZE,
  F_LORA_ID,
  F_MEDIUM,
  F_LORA_NAME,
  F_EXTRA,
  F_GROUP,
  F_SPEC_KIND,
  F_WINDOW,
  F_LOCALITY,
  F_OWNERSHIP,
  F_SESSION,
  F_LOOKAHEAD,
  F_COUNT
};

struct Event {
  Kind kind = Kind::Cleared;
  uint32_t h0 = 0, nh = 0;  // hashes[h0, h0 + nh)
  uint32_t t0 = 0, nt = 0;  // tokens[t0, t0 + nt)
  bool has_parent = false;
  Hash parent;
  int64_t block_size = 0;
  OptInt lora_id, group_idx, window;
  OptStr medium, lora_name, spec_kind, locality, ownership, session_id;
  bool has_extra = false;  // extra_keys: the raw msgpack span (validated)
  Span extra;
  bool has_lookahead = false;  // lookahead_token_ids: the raw msgpack span (validated)
  Span lookahead;
};

struct Batch {
  double ts = 0.0;
  bool has_rank = false;
  int64_t rank = 0;
  std::vector<Event> events;
  std::vector<Hash> hashes;
  std::vector<int64_t> tokens;
  uint64_t block_events = 0;

  void clear() {
    events.clear();
    hashes.clear();
    tokens.clear();
    has_rank = false;
    rank = 0;
    ts = 0.0;
    block_events = 0;
  }
};

enum class Result { Ok, Fallback };

constexpr int kMaxDepth = 32;

// ------------------------------------------------------------------------------------
// The reader: every read checks the bytes left; a failed read leaves the batch unusable
// (the caller falls back), so reads do not restore the position.

class Reader {
 public:
  Reader(const uint8_t* data, size_t n) : b_(data), p_(data), e_(data + n) {}

  size_t left() const { return static_cast<size_t>(e_ - p_); }
  bool at_end() const { return p_ == e_; }
  uint32_t pos() const { return static_cast<uint32_t>(p_ - b_); }
  const uint8_t* base() const { return b_; }

  bool peek(uint8_t& t) const {
    if (p_ >= e_) return false;
    t = *p_;
    return true;
  }

  bool nil() {  // consume a nil if one is next
    if (p_ < e_ && *p_ == 0xc0) {
      ++p_;
      return true;
    }
    return false;
  }

  // Any integer: ``u`` holds the value; ``neg`` says it is a negative int64 (two's
  // complement bits in ``u``).
  bool any_int(uint64_t& u, bool& neg) {
    if (p_ >= e_) return false;
    uint8_t t = *p_;
    neg = false;
    if (t <= 0x7f) {
      u = t;
      ++p_;
      return true;
    }
    if (t >= 0xe0) {
      u = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int8_t>(t)));
      neg = true;
      ++p_;
      return true;
    }
    switch (t) {
      case 0xcc: return uint_n(1, u);
      case 0xcd: return uint_n(2, u);
      case 0xce: return uint_n(4, u);
      case 0xcf: return uint_n(8, u);
      case 0xd0: return int_n(1, u, neg);
      case 0xd1: return int_n(2, u, neg);
      case 0xd2: return int_n(4, u, neg);
      case 0xd3: return int_n(8, u, neg);
      default: return false;
    }
  }

  // An integer in the signed 64-bit range.
  bool i64(int64_t& v) {
    uint64_t u;
    bool neg;
    if (!any_int(u, neg)) return false;
    if (!neg && u > static_cast<uint64_t>(INT64_MAX)) return false;
    v = static_cast<int64_t>(u);
    return true;
  }

  bool number(double& d) {  // a float or an int, as a float field reads it
    if (p_ >= e_) return false;
    uint8_t t = *p_;
    if (t == 0xcb) {
      if (left() < 9) return false;
      uint64_t bits = be(p_ + 1, 8);
      std::memcpy(&d, &bits, 8);
      p_ += 9;
      return true;
    }
    if (t == 0xca) {
      if (left() < 5) return false;
      uint32_t bits = static_cast<uint32_t>(be(p_ + 1, 4));
      float f;
      std::memcpy(&f, &bits, 4);
      d = static_cast<double>(f);
      p_ += 5;
      return true;
    }
    uint64_t u;
    bool neg;
    if (!any_int(u, neg)) return false;
    d = neg ? static_cast<double>(static_cast<int64_t>(u)) : static_cast<double>(u);
    return true;
  }

  bool str(Span& s) {
    if (p_ >= e_) return false;
    uint8_t t = *p_;
    uint64_t n;
    if (t >= 0xa0 && t <= 0xbf) {
      n = t & 0x1f;
      ++p_;
    } else if (t == 0xd9 || t == 0xda || t == 0xdb) {
      size_t w = t == 0xd9 ? 1 : t == 0xda ? 2 : 4;
      if (left() < 1 + w) return false;
      n = be(p_ + 1, w);
      p_ += 1 + w;
    } else {
      return false;
    }
    if (n > left()) return false;
    if (!utf8(p_, static_cast<size_t>(n))) return false;
    s.off = pos();
    s.len = static_cast<uint32_t>(n);
    p_ += n;
    return true;
  }

  bool bin(Span& s) {
    if (p_ >= e_) return false;
    uint8_t t = *p_;
    size_t w = t == 0xc4 ? 1 : t == 0xc5 ? 2 : t == 0xc6 ? 4 : 0;
    if (!w || left() < 1 + w) return false;
    uint64_t n = be(p_ + 1, w);
    p_ += 1 + w;
    if (n > left()) return false;
    s.off = pos();
    s.len = static_cast<uint32_t>(n);
    p_ += n;
    return true;
  }

  // An array header; ``n`` is bounded by the bytes left (each element takes one).
  bool array(uint32_t& n) { return header(n, 0x90, 0xdc, 0xdd); }
  bool map(uint32_t& n) {
    if (!header(n, 0x80, 0xde, 0xdf)) return false;
    return static_cast<uint64_t>(n) * 2 <= left();
  }

  bool is_array() const { return p_ < e_ && ((*p_ & 0xf0) == 0x90 || *p_ == 0xdc || *p_ == 0xdd); }
  bool is_map() const { return p_ < e_ && ((*p_ & 0xf0) == 0x80 || *p_ == 0xde || *p_ == 0xdf); }

  // Skip one well-formed value (no ext types; maps only when ``maps``).
  bool skip(int depth, bool maps) {
    if (depth > kMaxDepth || p_ >= e_) return false;
    uint8_t t = *p_;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) {
      ++p_;
      return true;
    }
    if ((t >= 0xcc && t <= 0xd3)) {
      uint64_t u;
      bool neg;
      return any_int(u, neg);
    }
    if (t == 0xca || t == 0xcb) {
      double d;
      return number(d);
    }
    Span s;
    if ((t >= 0xa0 && t <= 0xbf) || t == 0xd9 || t == 0xda || t == 0xdb) return str(s);
    if (t == 0xc4 || t == 0xc5 || t == 0xc6) return bin(s);
    uint32_t n;
    if (is_array()) {
      if (!array(n)) return false;
      for (uint32_t i = 0; i < n; ++i)
        if (!skip(depth + 1, maps)) return false;
      return true;
    }
    if (maps && is_map()) {
      if (!map(n)) return false;
      for (uint32_t i = 0; i < n; ++i) {
        // keys: strings or ints only (anything else may not be a hashable key)
        uint8_t k;
        if (!peek(k)) return false;
        if (k <= 0x7f || k >= 0xe0 || (k >= 0xcc && k <= 0xd3)) {
          uint64_t u;
          bool neg;
          if (!any_int(u, neg)) return false;
        } else if (!str(s)) {
          return false;
        }
        if (!skip(depth + 1, maps)) return false;
      }
      return true;
    }
    return false;  // 0xc1, ext, or a map where none is allowed
  }

  bool str_eq(const Span& s, std::string_view want) const {
    return s.len == want.size() && std::memcmp(b_ + s.off, want.data(), s.len) == 0;
  }

 private:
  static uint64_t be(const uint8_t* q, size_t w) {
    uint64_t v = 0;
    for (size_t i = 0; i < w; ++i) v = (v << 8) | q[i];
    return v;
  }

  bool uint_n(size_t w, uint64_t& u) {
    if (left() < 1 + w) return false;
    u = be(p_ + 1, w);
    p_ += 1 + w;
    return true;
  }

  bool int_n(size_t w, uint64_t& u, bool& neg) {
    if (left() < 1 + w) return false;
    uint64_t raw = be(p_ + 1, w);
    int64_t v;
    switch (w) {
      case 1: v = static_cast<int8_t>(raw); break;
      case 2: v = static_cast<int16_t>(raw); break;
      case 4: v = static_cast<int32_t>(raw); break;
      default: v = static_cast<int64_t>(raw); break;
    }
    u = static_cast<uint64_t>(v);
    neg = v < 0;
    p_ += 1 + w;
    return true;
  }

  bool header(uint32_t& n, uint8_t fix, uint8_t t16, uint8_t t32) {
    if (p_ >= e_) return false;
    uint8_t t = *p_;
    uint64_t m;
    if ((t & 0xf0) == fix) {
      m = t & 0x0f;
      ++p_;
    } else if (t == t16 || t == t32) {
      size_t w = t == t16 ? 2 : 4;
      if (left() < 1 + w) return false;
      m = be(p_ + 1, w);
      p_ += 1 + w;
    } else {
      return false;
    }
    if (m > left()) return false;
    n = static_cast<uint32_t>(m);
    return true;
  }

  // Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF.
  static bool utf8(const uint8_t* s, size_t n) {
    size_t i = 0;
    while (i < n) {
      uint8_t c = s[i];
      if (c < 0x80) {
        ++i;
        continue;
      }
      size_t k;
      uint32_t cp;
      if (c >= 0xc2 && c <= 0xdf) {
        k = 1;
        cp = c & 0x1f;
      } else if (c >= 0xe0 && c <= 0xef) {
        k = 2;
        cp = c & 0x0f;
      } else if (c >= 0xf0 && c <= 0xf4) {
        k = 3;
        cp = c & 0x07;
      } else {
        return false;
      }
      if (n - i < k + 1) return false;
      for (size_t j = 1; j <= k; ++j) {
        uint8_t d = s[i + j];
        if ((d & 0xc0) != 0x80) return false;
        cp = (cp << 6) | (d & 0x3f);
      }
      if ((k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000)) return false;
      if (cp >= 0xd800 && cp <= 0xdfff) return false;
      if (cp > 0x10ffff) return false;
      i += k + 1;
    }
    return true;
  }

  const uint8_t* b_;
  const uint8_t* p_;
  const uint8_t* e_;
};

// ------------------------------------------------------------------------------------
// The batch parser.

class Parser {
 public:
  Parser(const uint8_t* data, size_t n, Batch& out) : r_(data, n), out_(out) {}

  Result run() {
    out_.clear();
    if (r_.left() > UINT32_MAX) return Result::Fallback;
    uint32_t n;
    if (!r_.array(n) || n < 2 || n > 3) return Result::Fallback;
    if (!r_.number(out_.ts)) return Result::Fallback;
    uint32_t ne;
    if (!r_.array(ne)) return Result::Fallback;
    out_.events.reserve(ne);
    int form = -1;  // 0 map, 1 array: a typed decoder reads one form per batch
    for (uint32_t i = 0; i < ne; ++i) {
      int f = r_.is_map() ? 0 : r_.is_array() ? 1 : -2;
      if (f < 0 || (form >= 0 && f != form)) return Result::Fallback;
      form = f;
      out_.events.emplace_back();
      Event& ev = out_.events.back();
      if (!(f == 0 ? map_event(ev) : array_event(ev))) return Result::Fallback;
      out_.block_events += ev.nh;
    }
    if (n == 3 && !r_.nil()) {
      if (!r_.i64(out_.rank)) return Result::Fallback;
      out_.has_rank = true;
    }
    return r_.at_end() ? Result::Ok : Result::Fallback;
  }

 private:
  bool tag(Span& s, Kind& k) {
    if (!r_.str(s)) return false;
    if (r_.str_eq(s, "BlockStored")) {
      k = Kind::Stored;
    } else if (r_.str_eq(s, "BlockRemoved")) {
      k = Kind::Removed;
    } else if (r_.str_eq(s, "AllBlocksCleared")) {
      k = Kind::Cleared;
    } else {
      return false;  // unknown tags are the Python decoder's to skip and count
    }
    return true;
  }

  static int field_of(const Reader& r, Kind k, const Span& name) {
    static const char* const stored[F_COUNT] = {
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
        "lookahead_token_ids"};
    if (k == Kind::Stored) {
      for (int f = 0; f < F_COUNT; ++f)
        if (r.str_eq(name, stored[f])) return f;
    } else if (k == Kind::Removed) {
      static const int removed[] = {F_HASHES, F_MEDIUM, F_GROUP, F_LOCALITY, F_OWNERSHIP};
      for (int f : removed)
        if (r.str_eq(name, stored[f])) return f;
    }
    return -1;
  }

  bool map_event(Event& ev) {
    uint32_t nk;
    if (!r_.map(nk) || nk < 1) return false;
    Span key, tg;
    if (!r_.str(key) || !r_.str_eq(key, "type") || !tag(tg, ev.kind)) return false;
    uint32_t seen = 0;
    for (uint32_t i = 1; i < nk; ++i) {
      if (!r_.str(key)) return false;
      if (r_.str_eq(key, "type")) return false;  // a second tag
      int f = field_of(r_, ev.kind, key);
      if (f < 0) {
        if (!r_.skip(1, true)) return false;  // unknown keys are ignored
        continue;
      }
      if (seen & (1u << f)) return false;  // duplicate keys: leave them to Python
      seen |= 1u << f;
      if (!field(ev, f)) return false;
    }
    // the fields vLLM 0.33 declares without a default must all be present
    uint32_t need = 0;
    if (ev.kind == Kind::Stored) {
      need = (1u << F_HASHES) | (1u << F_PARENT) | (1u << F_TOKENS) | (1u << F_BLOCK_SIZE) |
             (1u << F_LORA_ID) | (1u << F_MEDIUM) | (1u << F_LORA_NAME);
    } else if (ev.kind == Kind::Removed) {
      need = (1u << F_HASHES) | (1u << F_MEDIUM);
    }
    return (seen & need) == need;
  }

  bool array_event(Event& ev) {
    uint32_t n;
    Span tg;
    if (!r_.array(n) || n < 1 || !tag(tg, ev.kind)) return false;
    static const int stored[] = {F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM,
                                 F_LORA_NAME, F_EXTRA, F_GROUP, F_SPEC_KIND, F_WINDOW};
    static const int removed[] = {F_HASHES, F_MEDIUM, F_GROUP};
    const int* order;
    uint32_t lo, hi;  // element counts, tag included
    if (ev.kind == Kind::Stored) {
      order = stored;
      lo = 5;
      hi = 12;
    } else if (ev.kind == Kind::Removed) {
      order = removed;
      lo = 2;
      hi = 4;
    } else {
      order = nullptr;
      lo = hi = 1;
    }
    if (n < lo || n > hi) return false;
    for (uint32_t i = 1; i < n; ++i)
      if (!field(ev, order[i - 1])) return false;
    return true;
  }

  bool hash(Hash& h) {
    uint8_t t;
    if (!r_.peek(t)) return false;
    if (t == 0xc4 || t == 0xc5 || t == 0xc6) {
      h.tag = HashTag::Bytes;
      return r_.bin(h.bytes);
    }
    bool neg;
    if (!r_.any_int(h.v, neg)) return false;
    h.tag = neg ? HashTag::Negative : HashTag::Unsigned;
    return true;
  }

  bool opt_int(OptInt& o) {
    if (r_.nil()) {
      o.has = false;
      return true;
    }
    o.has = true;
    return r_.i64(o.v);
  }

  bool opt_str(OptStr& o) {
    if (r_.nil()) {
      o.has = false;
      return true;
    }
    o.has = true;
    return r_.str(o.s);
  }

  bool field(Event& ev, int f) {
    uint32_t n;
    switch (f) {
      case F_HASHES: {
        if (!r_.array(n)) return false;
        ev.h0 = static_cast<uint32_t>(out_.hashes.size());
        ev.nh = n;
        for (uint32_t i = 0; i < n; ++i) {
          Hash h;
          if (!hash(h)) return false;
          out_.hashes.push_back(h);
        }
        return true;
      }
      case F_PARENT:
        if (r_.nil()) {
          ev.has_parent = false;
          return true;
        }
        ev.has_parent = true;
        return hash(ev.parent);
      case F_TOKENS: {
        if (!r_.array(n)) return false;
        ev.t0 = static_cast<uint32_t>(out_.tokens.size());
        ev.nt = n;
        for (uint32_t i = 0; i < n; ++i) {
          int64_t v;
          if (!r_.i64(v)) return false;
          out_.tokens.push_back(v);
        }
        return true;
      }
      case F_BLOCK_SIZE: return r_.i64(ev.block_size);
      case F_LORA_ID: return opt_int(ev.lora_id);
      case F_MEDIUM: return opt_str(ev.medium);
      case F_LORA_NAME: return opt_str(ev.lora_name);
      case F_EXTRA: {
        // list[tuple[Any, ...] | None] | None; no maps or ext values inside
        uint32_t start = r_.pos();
        if (r_.nil()) {
          ev.has_extra = false;
          return true;
        }
        if (!r_.array(n)) return false;
        for (uint32_t i = 0; i < n; ++i) {
          if (r_.nil()) continue;
          uint32_t m;
          if (!r_.array(m)) return false;
          for (uint32_t j = 0; j < m; ++j)
            if (!r_.skip(2, false)) return false;
        }
        ev.has_extra = true;
        ev.extra = Span{start, r_.pos() - start};
        return true;
      }
      case F_GROUP: return opt_int(ev.group_idx);
      case F_SPEC_KIND: return opt_str(ev.spec_kind);
      case F_WINDOW: return opt_int(ev.window);
      case F_LOCALITY: return opt_str(ev.locality);
      case F_OWNERSHIP: return opt_str(ev.ownership);
      case F_SESSION: return opt_str(ev.session_id);
      case F_LOOKAHEAD: {
        // list[list[int]] | None
        uint32_t start = r_.pos();
        if (r_.nil()) {
          ev.has_lookahead = false;
          return true;
        }
        if (!r_.array(n)) return false;
        for (uint32_t i = 0; i < n; ++i) {
          uint32_t m;
          if (!r_.array(m)) return false;
          for (uint32_t j = 0; j < m; ++j) {
            uint64_t u;
            bool neg;
            if (!r_.any_int(u, neg)) return false;
          }
        }
        ev.has_lookahead = true;
        ev.lookahead = Span{start, r_.pos() - start};
        return true;
      }
      default: return false;
    }
  }

  Reader r_;
  Batch& out_;
};

inline Result parse(const uint8_t* data, size_t n, Batch& out) { return Parser(data, n, out).run(); }

}  // namespace kvn
