// kvevents-native: the Python module (nanobind).
//
// One job: expose the wire parser (parse_batch -> ParsedBatch or None) and the content-key
// kernels (prompt_keys, chain_units, ParsedBatch.block_keys and .chain_blocks) to kvevents.
// Python objects are built only when asked for (ParsedBatch.event, for the differential
// tests and the fallback; ParsedBatch.ops, the batch as BlockIndex.apply_payload applies
// it: a run of GPU removals is one item, token ids stay bytes); the parse itself
// allocates none.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "assemble.hpp"
#include "keys.hpp"
#include "lookup.hpp"
#include "marks.hpp"
#include "records.hpp"
#include "walk.hpp"
#include "wire.hpp"

namespace nb = nanobind;

namespace {

// A parsed payload: the flat batch plus the bytes its spans point into.
class ParsedBatch {
 public:
  ParsedBatch(nb::object owner, const uint8_t* data, size_t n, kvn::Batch&& b)
      : owner_(std::move(owner)), data_(data), n_(n), b_(std::move(b)) {}

  double ts() const { return b_.ts; }
  nb::object rank() const {
    return b_.has_rank ? nb::steal(PyLong_FromLongLong(b_.rank)) : nb::none();
  }
  size_t len() const { return b_.events.size(); }
  uint64_t block_events() const { return b_.block_events; }

  // 0 BlockStored, 1 BlockRemoved, 2 AllBlocksCleared
  int kind(size_t i) const { return static_cast<int>(at(i).kind); }

  // The event's fields as a tuple: (tag, *fields in vLLM 0.33 order); extra_keys and
  // lookahead_token_ids are their msgpack bytes (or None) for the caller to decode.
  nb::object event(size_t i) const {
    const kvn::Event& e = at(i);
    switch (e.kind) {
      case kvn::Kind::Stored: {
        PyObject* t = PyTuple_New(16);
        if (!t) throw nb::python_error();
        nb::object own = nb::steal(t);
        PyTuple_SET_ITEM(t, 0, str_of("BlockStored"));
        PyTuple_SET_ITEM(t, 1, hashes(e));
        PyTuple_SET_ITEM(t, 2, e.has_parent ? hash(e.parent) : none());
        PyObject* toks = PyList_New(e.nt);
        if (toks) {
          for (uint32_t j = 0; j < e.nt; ++j)
            PyList_SET_ITEM(toks, j, PyLong_FromLongLong(b_.tokens[e.t0 + j]));
        }
        PyTuple_SET_ITEM(t, 3, toks);
        set_store_fields(t, 4, e);
        return own;
      }
      case kvn::Kind::Removed: {
        PyObject* t = PyTuple_New(6);
        if (!t) throw nb::python_error();
        PyTuple_SET_ITEM(t, 0, str_of("BlockRemoved"));
        PyTuple_SET_ITEM(t, 1, hashes(e));
        PyTuple_SET_ITEM(t, 2, opt_str(e.medium));
        PyTuple_SET_ITEM(t, 3, opt_int(e.group_idx));
        PyTuple_SET_ITEM(t, 4, opt_str(e.locality));
        PyTuple_SET_ITEM(t, 5, opt_str(e.ownership));
        return nb::steal(t);
      }
      default: {
        PyObject* t = PyTuple_New(1);
        if (!t) throw nb::python_error();
        PyTuple_SET_ITEM(t, 0, str_of("AllBlocksCleared"));
        return nb::steal(t);
      }
    }
  }

  // The content key at the end of each engine block of BlockStored ``i``, chained on
  // ``parent`` with ``unit`` tokens per key, ignoring extra keys; None when the event
  // is not a whole number of blocks of a multiple of ``unit`` tokens.
  nb::object block_keys(size_t i, uint64_t parent, int64_t unit) const {
    const kvn::Event& e = at(i);
    if (e.kind != kvn::Kind::Stored || unit <= 0 || e.block_size <= 0 ||
        e.block_size % unit != 0 ||
        static_cast<uint64_t>(e.nt) != static_cast<uint64_t>(e.nh) * static_cast<uint64_t>(e.block_size))
      return nb::none();
    const size_t per = static_cast<size_t>(e.block_size / unit);
    PyObject* out = PyList_New(e.nh);
    if (!out) throw nb::python_error();
    uint64_t k = parent;
    const int64_t* t = b_.tokens.data() + e.t0;
    for (uint32_t j = 0; j < e.nh; ++j) {
      k = kvn::chain_units(k, t + static_cast<size_t>(j) * e.block_size, per, static_cast<size_t>(unit));
      PyList_SET_ITEM(out, j, PyLong_FromUnsignedLongLong(k));
    }
    return nb::steal(out);
  }

  // The batch as the index applies it, one item per step (no event objects):
  //   (0, i, hashes, parent, token_bytes, block_size, lora_id, medium, lora_name,
  //    extra_keys_raw, group_idx, spec_kind, window, locality, ownership, session_id,
  //    lookahead_raw)                                    a BlockStored (event i);
  //   (1, hashes, medium, group_idx, locality, ownership) a BlockRemoved not on "GPU";
  //   (2,)                                                an AllBlocksCleared;
  //   (3, count, group, hashes)   ``count`` consecutive BlockRemoved with medium "GPU"
  //                               of one group (``group_idx or 0``), hashes in order.
  // token_bytes are the ids as little-endian int64; the raw fields are msgpack bytes.
  nb::object ops() const {
    nb::list out;
    const size_t n = b_.events.size();
    size_t i = 0;
    while (i < n) {
      const kvn::Event& e = b_.events[i];
      if (e.kind == kvn::Kind::Removed && gpu(e)) {
        const int64_t group = e.group_idx.has ? e.group_idx.v : 0;
        size_t j = i;
        size_t nh = 0;
        while (j < n && b_.events[j].kind == kvn::Kind::Removed && gpu(b_.events[j]) &&
               (b_.events[j].group_idx.has ? b_.events[j].group_idx.v : 0) == group) {
          nh += b_.events[j].nh;
          ++j;
        }
        PyObject* l = PyList_New(static_cast<Py_ssize_t>(nh));
        if (!l) throw nb::python_error();
        nb::object hs = nb::steal(l);
        size_t k = 0;
        for (size_t x = i; x < j; ++x) {
          const kvn::Event& r = b_.events[x];
          for (uint32_t y = 0; y < r.nh; ++y) {
            PyObject* h = hash(b_.hashes[r.h0 + y]);
            if (!h) throw nb::python_error();
            PyList_SET_ITEM(l, static_cast<Py_ssize_t>(k++), h);
          }
        }
        out.append(nb::make_tuple(3, j - i, group, hs));
        i = j;
        continue;
      }
      switch (e.kind) {
        case kvn::Kind::Stored: {
          PyObject* t = PyTuple_New(17);
          if (!t) throw nb::python_error();
          nb::object own = nb::steal(t);
          PyTuple_SET_ITEM(t, 0, PyLong_FromLong(0));
          PyTuple_SET_ITEM(t, 1, PyLong_FromSize_t(i));
          PyTuple_SET_ITEM(t, 2, hashes(e));
          PyTuple_SET_ITEM(t, 3, e.has_parent ? hash(e.parent) : none());
          PyTuple_SET_ITEM(t, 4, PyBytes_FromStringAndSize(
                                     reinterpret_cast<const char*>(b_.tokens.data() + e.t0),
                                     static_cast<Py_ssize_t>(e.nt) * 8));
          set_store_fields(t, 5, e);
          out.append(own);
          break;
        }
        case kvn::Kind::Removed: {
          PyObject* t = PyTuple_New(6);
          if (!t) throw nb::python_error();
          nb::object own = nb::steal(t);
          PyTuple_SET_ITEM(t, 0, PyLong_FromLong(1));
          PyTuple_SET_ITEM(t, 1, hashes(e));
          PyTuple_SET_ITEM(t, 2, opt_str(e.medium));
          PyTuple_SET_ITEM(t, 3, opt_int(e.group_idx));
          PyTuple_SET_ITEM(t, 4, opt_str(e.locality));
          PyTuple_SET_ITEM(t, 5, opt_str(e.ownership));
          for (Py_ssize_t x = 0; x < 6; ++x)
            if (!PyTuple_GET_ITEM(t, x)) throw nb::python_error();
          out.append(own);
          break;
        }
        default: out.append(nb::make_tuple(2)); break;
      }
      ++i;
    }
    return out;
  }

  // Up to ``limit`` chain keys of BlockStored ``i``'s consecutive blocks of ``size``
  // tokens from token ``start``, the first chained on ``parent``, ``unit`` tokens per
  // key (no extra keys); as many as whole blocks remain.  None when ``size`` is not a
  // positive multiple of a positive ``unit`` or ``start`` is outside the tokens.
  nb::object chain_blocks(size_t i, int64_t start, int64_t size, uint64_t parent, int64_t unit,
                          int64_t limit) const {
    const kvn::Event& e = at(i);
    if (e.kind != kvn::Kind::Stored || unit <= 0 || size <= 0 || size % unit != 0 ||
        start < 0 || start > static_cast<int64_t>(e.nt) || limit < 0)
      return nb::none();
    const int64_t avail = (static_cast<int64_t>(e.nt) - start) / size;
    const int64_t count = avail < limit ? avail : limit;
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(count));
    if (!out) throw nb::python_error();
    nb::object own = nb::steal(out);
    const size_t per = static_cast<size_t>(size / unit);
    const int64_t* t = b_.tokens.data() + e.t0 + start;
    uint64_t k = parent;
    for (int64_t j = 0; j < count; ++j) {
      k = kvn::chain_units(k, t + j * size, per, static_cast<size_t>(unit));
      PyObject* v = PyLong_FromUnsignedLongLong(k);
      if (!v) throw nb::python_error();
      PyList_SET_ITEM(out, static_cast<Py_ssize_t>(j), v);
    }
    return own;
  }

 private:
  bool gpu(const kvn::Event& e) const { return e.medium.has && reader_eq(e.medium.s, "GPU"); }
  bool reader_eq(const kvn::Span& s, const char* want) const {
    const size_t n = std::strlen(want);
    return s.len == n && std::memcmp(data_ + s.off, want, n) == 0;
  }
  const kvn::Event& at(size_t i) const {
    if (i >= b_.events.size()) throw nb::index_error("event index out of range");
    return b_.events[i];
  }
  static PyObject* none() { Py_RETURN_NONE; }
  static PyObject* str_of(const char* s) { return PyUnicode_FromString(s); }
  PyObject* str(const kvn::Span& s) const {
    return PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(data_ + s.off), s.len, "strict");
  }
  PyObject* raw(const kvn::Span& s) const {
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(data_ + s.off), s.len);
  }
  PyObject* opt_str(const kvn::OptStr& o) const { return o.has ? str(o.s) : none(); }
  static PyObject* opt_int(const kvn::OptInt& o) {
    return o.has ? PyLong_FromLongLong(o.v) : none();
  }
  PyObject* hash(const kvn::Hash& h) const {
    switch (h.tag) {
      case kvn::HashTag::Bytes: return raw(h.bytes);
      case kvn::HashTag::Negative: return PyLong_FromLongLong(static_cast<int64_t>(h.v));
      default: return PyLong_FromUnsignedLongLong(h.v);
    }
  }
  PyObject* hashes(const kvn::Event& e) const {
    PyObject* l = PyList_New(e.nh);
    if (!l) throw nb::python_error();
    for (uint32_t j = 0; j < e.nh; ++j) PyList_SET_ITEM(l, j, hash(b_.hashes[e.h0 + j]));
    return l;
  }
  // A store's fields from block_size on (vLLM 0.33 order), into ``t`` from index ``at``
  // to its end; then every item of ``t`` must have been built (else the Python error).
  void set_store_fields(PyObject* t, Py_ssize_t at, const kvn::Event& e) const {
    PyTuple_SET_ITEM(t, at, PyLong_FromLongLong(e.block_size));
    PyTuple_SET_ITEM(t, at + 1, opt_int(e.lora_id));
    PyTuple_SET_ITEM(t, at + 2, opt_str(e.medium));
    PyTuple_SET_ITEM(t, at + 3, opt_str(e.lora_name));
    PyTuple_SET_ITEM(t, at + 4, e.has_extra ? raw(e.extra) : none());
    PyTuple_SET_ITEM(t, at + 5, opt_int(e.group_idx));
    PyTuple_SET_ITEM(t, at + 6, opt_str(e.spec_kind));
    PyTuple_SET_ITEM(t, at + 7, opt_int(e.window));
    PyTuple_SET_ITEM(t, at + 8, opt_str(e.locality));
    PyTuple_SET_ITEM(t, at + 9, opt_str(e.ownership));
    PyTuple_SET_ITEM(t, at + 10, opt_str(e.session_id));
    PyTuple_SET_ITEM(t, at + 11, e.has_lookahead ? raw(e.lookahead) : none());
    for (Py_ssize_t x = 0; x < PyTuple_GET_SIZE(t); ++x)
      if (!PyTuple_GET_ITEM(t, x)) throw nb::python_error();
  }

  nb::object owner_;
  const uint8_t* data_;
  size_t n_;
  kvn::Batch b_;
};

// ``payload`` as (owner, pointer, size): bytes are read in place; any other buffer is
// copied first, so a bytearray changed later cannot move what the spans point at.
struct Payload {
  nb::object owner;
  const uint8_t* data = nullptr;
  size_t n = 0;
};

Payload payload_of(nb::handle obj) {
  Payload p;
  if (PyBytes_Check(obj.ptr())) {
    p.owner = nb::borrow(obj);
  } else {
    Py_buffer view;
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
    PyObject* copy = PyBytes_FromStringAndSize(static_cast<const char*>(view.buf), view.len);
    PyBuffer_Release(&view);
    if (!copy) throw nb::python_error();
    p.owner = nb::steal(copy);
  }
  p.data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(p.owner.ptr()));
  p.n = static_cast<size_t>(PyBytes_GET_SIZE(p.owner.ptr()));
  return p;
}

nb::object parse_batch(nb::handle payload) {
  Payload p = payload_of(payload);
  kvn::Batch b;
  if (kvn::parse(p.data, p.n, b) != kvn::Result::Ok) return nb::none();
  return nb::cast(ParsedBatch(std::move(p.owner), p.data, p.n, std::move(b)));
}

// Token ids of a Python sequence as int64; TypeError or OverflowError as struct.pack.
std::vector<int64_t> tokens_of(nb::handle seq) {
  PyObject* fast = PySequence_Fast(seq.ptr(), "token ids must be a sequence");
  if (!fast) throw nb::python_error();
  nb::object guard = nb::steal(fast);
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* it = items[i];
    long long v;
    if (PyLong_CheckExact(it)) {
      int overflow = 0;
      v = PyLong_AsLongLongAndOverflow(it, &overflow);
      if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "token id out of the signed 64-bit range");
        throw nb::python_error();
      }
    } else {
      if (!PyIndex_Check(it)) {
        PyErr_Format(PyExc_TypeError, "token id must be an integer, got %.80s", Py_TYPE(it)->tp_name);
        throw nb::python_error();
      }
      v = PyLong_AsLongLong(it);
      if (v == -1 && PyErr_Occurred()) throw nb::python_error();
    }
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

nb::object prompt_keys(nb::handle tokens, int64_t unit, uint64_t root) {
  if (unit <= 0) throw nb::value_error("unit must be positive");
  std::vector<int64_t> t = tokens_of(tokens);
  const size_t u = static_cast<size_t>(unit);
  const size_t n = t.size() / u;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(n));
  if (!out) throw nb::python_error();
  uint64_t k = root;
  for (size_t j = 0; j < n; ++j) {
    k = kvn::chain_units(k, t.data() + j * u, 1, u);
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(j), PyLong_FromUnsignedLongLong(k));
  }
  return nb::steal(out);
}

uint64_t chain_units(uint64_t parent, nb::handle tokens, int64_t unit) {
  if (unit <= 0) throw nb::value_error("unit must be positive");
  std::vector<int64_t> t = tokens_of(tokens);
  const size_t u = static_cast<size_t>(unit);
  return kvn::chain_units(parent, t.data(), t.size() / u, u);
}

// --- SlotMarks: kvn::SlotMarks as kvevents.consumers.index.marks.TierMarks -----------

// A bitset as a non-negative Python int.
PyObject* int_of_words(const kvn::SlotMarks::Words& w) {
  if (w.empty()) return PyLong_FromLong(0);
  return _PyLong_FromByteArray(reinterpret_cast<const unsigned char*>(w.data()), w.size() * 8,
                               1, 0);
}

// A non-negative Python int as a bitset.
kvn::SlotMarks::Words words_of_int(nb::handle o) {
  try {
    const size_t n = kvn::words_of(o.ptr());
    kvn::Bits out;
    std::vector<unsigned char> scratch;
    kvn::read_bits(o.ptr(), n, out, scratch);
    return out;
  } catch (const kvn::WalkError&) {
    throw nb::python_error();
  }
}

// ``key`` as a content key, or false when no content key equals it (not an int, or out
// of the unsigned 64-bit range): a dict of such keys would not hold it either.
bool as_key(nb::handle key, uint64_t& out) {
  if (!PyLong_Check(key.ptr())) return false;
  out = PyLong_AsUnsignedLongLong(key.ptr());
  if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

nb::object marks_get(const kvn::SlotMarks& m, nb::handle key, nb::handle dflt) {
  uint64_t k;
  if (as_key(key, k)) {
    kvn::SlotMarks::Words w = m.holders(k);
    if (!w.empty()) {
      PyObject* r = int_of_words(w);
      if (!r) throw nb::python_error();
      return nb::steal(r);
    }
  }
  return nb::borrow(dflt);
}

nb::object marks_keys(const kvn::SlotMarks& m) {
  std::vector<uint64_t> keys = m.keys_in_order();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(keys.size()));
  if (!out) throw nb::python_error();
  nb::object own = nb::steal(out);
  for (size_t i = 0; i < keys.size(); ++i) {
    PyObject* k = PyLong_FromUnsignedLongLong(keys[i]);
    if (!k) throw nb::python_error();
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), k);
  }
  return own;
}

nb::object marks_items(const kvn::SlotMarks& m) {
  std::vector<uint64_t> keys = m.keys_in_order();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(keys.size()));
  if (!out) throw nb::python_error();
  nb::object own = nb::steal(out);
  for (size_t i = 0; i < keys.size(); ++i) {
    nb::object k = nb::steal(PyLong_FromUnsignedLongLong(keys[i]));
    nb::object v = nb::steal(int_of_words(m.holders(keys[i])));
    if (!k.is_valid() || !v.is_valid()) throw nb::python_error();
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), nb::make_tuple(k, v).release().ptr());
  }
  return own;
}

nb::object marks_dup_items(const kvn::SlotMarks& m) {
  nb::list out;
  for (const auto& d : m.dups_in_order()) {
    kvn::SlotMarks::Words bit(d.slot / 64 + 1, 0);
    bit[d.slot / 64] = uint64_t{1} << (d.slot % 64);
    nb::object b = nb::steal(int_of_words(bit));
    if (!b.is_valid()) throw nb::python_error();
    out.append(nb::make_tuple(nb::make_tuple(d.key, b), d.count));
  }
  return std::move(out);
}

// ``get`` as the SlotMarks it is the bound ``get`` method of, or null.
const kvn::SlotMarks* marks_of_get(nb::handle get) {
  PyObject* self = PyObject_GetAttrString(get.ptr(), "__self__");
  if (!self) {
    PyErr_Clear();
    return nullptr;
  }
  nb::object own = nb::steal(self);
  kvn::SlotMarks* m = nullptr;
  if (nb::try_cast<kvn::SlotMarks*>(own, m)) return m;
  return nullptr;
}

// --- RecordTable: kvn::RecordTable as a dict of engine hash -> record ---------------

// An engine hash the table keeps natively: an int in [0, 2**64).
bool hash_fits(PyObject* k, uint64_t& out) {
  if (!PyLong_CheckExact(k)) return false;
  out = PyLong_AsUnsignedLongLong(k);
  if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// A record the table keeps natively: an int in (0, 2**192), as little-endian words.
bool record_fits(PyObject* v, uint64_t* w) {
  if (!PyLong_CheckExact(v) || _PyLong_Sign(v) <= 0) return false;
#if PY_VERSION_HEX >= 0x030D0000
  Py_ssize_t n = PyLong_AsNativeBytes(v, w, 24,
                                      Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
  if (n < 0) {
    PyErr_Clear();
    return false;
  }
  return n <= 24;
#else
  if (_PyLong_AsByteArray(reinterpret_cast<PyLongObject*>(v), reinterpret_cast<unsigned char*>(w),
                          24, 1, 0) < 0) {
    PyErr_Clear();  // wider than 192 bits
    return false;
  }
  return true;
#endif
}

PyObject* record_int(const uint64_t* w) {
  return _PyLong_FromByteArray(reinterpret_cast<const unsigned char*>(w), 24, 1, 0);
}

// One KV-cache group's records: natively while every hash and record fits, else (from
// the first that does not, for good) a Python dict of the same items in the same order.
class RecordTableObj {
 public:
  nb::object get(nb::handle key, nb::handle dflt) const {
    if (spill_.is_valid()) {
      PyObject* v = PyDict_GetItemWithError(spill_.ptr(), key.ptr());
      if (v) return nb::borrow(v);
      if (PyErr_Occurred()) throw nb::python_error();
      return nb::borrow(dflt);
    }
    uint64_t k;
    if (hash_fits(key.ptr(), k)) {
      if (const uint64_t* w = t_.find(k)) return nb::steal(checked(record_int(w)));
    }
    return nb::borrow(dflt);
  }

  nb::object getitem(nb::handle key) const {
    nb::object v = get(key, nb::handle());
    if (!v.is_valid()) {
      PyErr_SetObject(PyExc_KeyError, key.ptr());
      throw nb::python_error();
    }
    return v;
  }

  void setitem(nb::handle key, nb::handle value) {
    if (!spill_.is_valid()) {
      uint64_t k;
      uint64_t w[3] = {0, 0, 0};
      if (hash_fits(key.ptr(), k) && record_fits(value.ptr(), w)) return t_.set(k, w);
      spill();
    }
    if (PyDict_SetItem(spill_.ptr(), key.ptr(), value.ptr()) < 0) throw nb::python_error();
  }

  void delitem(nb::handle key) {
    if (spill_.is_valid()) {
      if (PyDict_DelItem(spill_.ptr(), key.ptr()) < 0) throw nb::python_error();
      return;
    }
    uint64_t k;
    if (!hash_fits(key.ptr(), k) || !t_.erase(k)) {
      PyErr_SetObject(PyExc_KeyError, key.ptr());
      throw nb::python_error();
    }
  }

  nb::object pop(nb::handle key, nb::handle dflt) {
    nb::object v = get(key, nb::handle());
    if (!v.is_valid()) {
      if (!dflt.is_valid()) {
        PyErr_SetObject(PyExc_KeyError, key.ptr());
        throw nb::python_error();
      }
      return nb::borrow(dflt);
    }
    delitem(key);
    return v;
  }

  bool contains(nb::handle key) const {
    if (spill_.is_valid()) {
      int r = PyDict_Contains(spill_.ptr(), key.ptr());
      if (r < 0) throw nb::python_error();
      return r != 0;
    }
    uint64_t k;
    return hash_fits(key.ptr(), k) && t_.find(k) != nullptr;
  }

  size_t len() const { return spill_.is_valid() ? PyDict_GET_SIZE(spill_.ptr()) : t_.size(); }

  // keys (0), values (1) or items (2), in insertion order, as a new list
  nb::object listed(int what) const {
    if (spill_.is_valid()) {
      PyObject* r = what == 0   ? PyDict_Keys(spill_.ptr())
                    : what == 1 ? PyDict_Values(spill_.ptr())
                                : PyDict_Items(spill_.ptr());
      return nb::steal(checked(r));
    }
    nb::object out = nb::steal(checked(PyList_New(static_cast<Py_ssize_t>(t_.size()))));
    Py_ssize_t i = 0;
    t_.each([&](const kvn::RecordTable::Entry& e) {
      PyObject* item;
      if (what == 0) {
        item = checked(PyLong_FromUnsignedLongLong(e.key));
      } else if (what == 1) {
        item = checked(record_int(e.w));
      } else {
        nb::object k = nb::steal(checked(PyLong_FromUnsignedLongLong(e.key)));
        nb::object v = nb::steal(checked(record_int(e.w)));
        item = checked(PyTuple_Pack(2, k.ptr(), v.ptr()));
      }
      PyList_SET_ITEM(out.ptr(), i++, item);
    });
    return out;
  }

  void clear() {
    if (spill_.is_valid()) {
      PyDict_Clear(spill_.ptr());
    } else {
      t_.clear();
    }
  }

  // Whether no item of ``hashes`` is a key here.
  bool isdisjoint(nb::handle hashes) const {
    nb::object it = nb::steal(checked(PyObject_GetIter(hashes.ptr())));
    while (PyObject* h = PyIter_Next(it.ptr())) {
      nb::object own = nb::steal(h);
      if (contains(own)) return false;
    }
    if (PyErr_Occurred()) throw nb::python_error();
    return true;
  }

  bool spilled() const { return spill_.is_valid(); }
  size_t nbytes() const { return t_.nbytes(); }
  // the native table (only while not spilled)
  kvn::RecordTable& table() { return t_; }
  const kvn::RecordTable& table() const { return t_; }

  int traverse(visitproc visit, void* arg) {
    Py_VISIT(spill_.ptr());
    return 0;
  }
  void drop_spill() { spill_.reset(); }

 private:
  static PyObject* checked(PyObject* o) {
    if (!o) throw nb::python_error();
    return o;
  }

  // From now on a Python dict holds the items (in the same order).
  void spill() {
    nb::object d = nb::steal(checked(PyDict_New()));
    t_.each([&](const kvn::RecordTable::Entry& e) {
      nb::object k = nb::steal(checked(PyLong_FromUnsignedLongLong(e.key)));
      nb::object v = nb::steal(checked(record_int(e.w)));
      if (PyDict_SetItem(d.ptr(), k.ptr(), v.ptr()) < 0) throw nb::python_error();
    });
    t_.clear();
    spill_ = std::move(d);
  }

  kvn::RecordTable t_;
  nb::object spill_;
};

// The retained records' order (kvevents.consumers.index.join.Retention.records: an
// OrderedDict of (worker, group, hash) -> None): natively while every key is a tuple of a
// hashable worker id, a group in [0, 2**32) and a hash in [0, 2**64) and every value
// None, else (for good) an OrderedDict of the same items in the same order.  Worker ids
// are kept once each, numbered in the order first seen.
class RetainedQueueObj {
 public:
  RetainedQueueObj() : ids_(nb::steal(checked(PyDict_New()))), wids_(nb::steal(checked(PyList_New(0)))) {}

  void setitem(nb::handle key, nb::handle value) {
    if (!spill_.is_valid()) {
      uint64_t a, b;
      if (value.is_none() && key_of(key, a, b, true)) return q_.add(a, b);
      spill();
    }
    if (PyObject_SetItem(spill_.ptr(), key.ptr(), value.ptr()) < 0) throw nb::python_error();
  }

  nb::object pop(nb::handle key, nb::handle dflt) {
    if (spill_.is_valid()) {
      nb::object fn = nb::steal(checked(PyObject_GetAttrString(spill_.ptr(), "pop")));
      PyObject* r = dflt.is_valid() ? PyObject_CallFunctionObjArgs(fn.ptr(), key.ptr(), dflt.ptr(), nullptr)
                                    : PyObject_CallFunctionObjArgs(fn.ptr(), key.ptr(), nullptr);
      return nb::steal(checked(r));
    }
    uint64_t a, b;
    if (key_of(key, a, b, false) && q_.remove(a, b)) return nb::none();
    if (!dflt.is_valid()) {
      PyErr_SetObject(PyExc_KeyError, key.ptr());
      throw nb::python_error();
    }
    return nb::borrow(dflt);
  }

  nb::object popitem(bool last) {
    if (!spill_.is_valid() && !last) {
      uint64_t a, b;
      if (!q_.pop_first(a, b)) {
        PyErr_SetString(PyExc_KeyError, "dictionary is empty");
        throw nb::python_error();
      }
      return nb::make_tuple(key_obj(a, b), nb::none());
    }
    if (!spill_.is_valid()) spill();
    nb::object fn = nb::steal(checked(PyObject_GetAttrString(spill_.ptr(), "popitem")));
    return nb::steal(checked(PyObject_CallFunctionObjArgs(fn.ptr(), last ? Py_True : Py_False, nullptr)));
  }

  bool contains(nb::handle key) const {
    if (spill_.is_valid()) {
      int r = PySequence_Contains(spill_.ptr(), key.ptr());
      if (r < 0) throw nb::python_error();
      return r != 0;
    }
    uint64_t a, b;
    return const_cast<RetainedQueueObj*>(this)->key_of(key, a, b, false) && q_.contains(a, b);
  }

  size_t len() const {
    if (!spill_.is_valid()) return q_.size();
    Py_ssize_t n = PyObject_Size(spill_.ptr());
    if (n < 0) throw nb::python_error();
    return static_cast<size_t>(n);
  }

  // keys (false) or (key, value) items (true), oldest first, as a new list
  nb::object listed(bool items) const {
    if (spill_.is_valid()) {
      nb::object fn = nb::steal(checked(PyObject_GetAttrString(spill_.ptr(), items ? "items" : "keys")));
      nb::object view = nb::steal(checked(PyObject_CallNoArgs(fn.ptr())));
      return nb::steal(checked(PySequence_List(view.ptr())));
    }
    nb::list out;
    q_.each([&](const kvn::KeyQueue::Entry& e) {
      nb::object k = key_obj(e.a, e.b);
      if (items) {
        out.append(nb::make_tuple(k, nb::none()));
      } else {
        out.append(k);
      }
    });
    return std::move(out);
  }

  void clear() {
    if (spill_.is_valid()) {
      nb::object fn = nb::steal(checked(PyObject_GetAttrString(spill_.ptr(), "clear")));
      nb::steal(checked(PyObject_CallNoArgs(fn.ptr())));
    } else {
      q_.clear();
    }
  }

  bool spilled() const { return spill_.is_valid(); }
  size_t nbytes() const { return q_.nbytes(); }

  int traverse(visitproc visit, void* arg) {
    Py_VISIT(ids_.ptr());
    Py_VISIT(wids_.ptr());
    Py_VISIT(spill_.ptr());
    return 0;
  }
  void drop_refs() {
    spill_.reset();
    PyDict_Clear(ids_.ptr());
    q_.clear();
  }

 private:
  static PyObject* checked(PyObject* o) {
    if (!o) throw nb::python_error();
    return o;
  }

  // ``key`` as the queue's two words; false when it is not one the queue holds
  // natively (or, without ``intern``, names a worker never seen)
  bool key_of(nb::handle key, uint64_t& a, uint64_t& b, bool intern) {
    PyObject* k = key.ptr();
    if (!PyTuple_CheckExact(k) || PyTuple_GET_SIZE(k) != 3) return false;
    PyObject* group = PyTuple_GET_ITEM(k, 1);
    uint64_t g;
    if (!hash_fits(group, g) || g >= (uint64_t{1} << 32)) return false;
    if (!hash_fits(PyTuple_GET_ITEM(k, 2), b)) return false;
    PyObject* wid = PyTuple_GET_ITEM(k, 0);
    PyObject* id = PyDict_GetItemWithError(ids_.ptr(), wid);
    uint64_t n;
    if (id) {
      n = PyLong_AsUnsignedLongLong(id);
    } else {
      if (PyErr_Occurred()) throw nb::python_error();  // an unhashable worker id
      if (!intern) return false;
      n = static_cast<uint64_t>(PyList_GET_SIZE(wids_.ptr()));
      if (n >= 0xFFFFFFFFull) return false;
      nb::object num = nb::steal(checked(PyLong_FromUnsignedLongLong(n)));
      if (PyDict_SetItem(ids_.ptr(), wid, num.ptr()) < 0 || PyList_Append(wids_.ptr(), wid) < 0)
        throw nb::python_error();
    }
    a = n << 32 | g;
    return true;
  }

  nb::object key_obj(uint64_t a, uint64_t b) const {
    PyObject* wid = PyList_GET_ITEM(wids_.ptr(), static_cast<Py_ssize_t>(a >> 32));
    nb::object g = nb::steal(checked(PyLong_FromUnsignedLongLong(a & 0xFFFFFFFFull)));
    nb::object h = nb::steal(checked(PyLong_FromUnsignedLongLong(b)));
    return nb::make_tuple(nb::borrow(wid), g, h);
  }

  void spill() {
    nb::object mod = nb::steal(checked(PyImport_ImportModule("collections")));
    nb::object od_type = nb::steal(checked(PyObject_GetAttrString(mod.ptr(), "OrderedDict")));
    nb::object d = nb::steal(checked(PyObject_CallNoArgs(od_type.ptr())));
    q_.each([&](const kvn::KeyQueue::Entry& e) {
      if (PyObject_SetItem(d.ptr(), key_obj(e.a, e.b).ptr(), Py_None) < 0) throw nb::python_error();
    });
    q_.clear();
    spill_ = std::move(d);
  }

  kvn::KeyQueue q_;
  nb::object ids_;   // worker id -> its number
  nb::object wids_;  // number -> worker id
  nb::object spill_;
};

int retained_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  return nb::inst_ptr<RetainedQueueObj>(self)->traverse(visit, arg);
}

int retained_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<RetainedQueueObj>(self)->drop_refs();
  return 0;
}

PyType_Slot retained_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(retained_traverse)},
                                {Py_tp_clear, reinterpret_cast<void*>(retained_clear)},
                                {0, nullptr}};

// The new blocks of a plain GPU store, from block ``first``, by the rules of
// kvevents.consumers.index.stores._StoreRun.new_record and RefRules.ref for them (the
// Python is the specification; tests/consumers/test_index_apply_payload.py holds this to
// it): each block's content key chained on the one before (``key``; ``size / unit``
// units of the packed int64 token ids from token ``off + i * size``), its record packed
// as records.pack packs it (content key, end in blocks, size, parent + 1, one GPU
// reference), its GPU mark, and whether it became resident (no CPU/STORAGE refcount).
// Stops at the first block it does not store so (a hash that is not a 64-bit int, one
// with a record, an end that does not pack).  Returns (next block, key, end, parent,
// entries made resident).
nb::tuple gpu_store_blocks(RecordTableObj& meta, const RecordTableObj& cpu,
                           const RecordTableObj& storage, kvn::SlotMarks& marks, uint32_t slot,
                           nb::handle hashes, size_t first, nb::handle packed, int64_t off,
                           int64_t size, int64_t unit, uint64_t key, nb::handle end,
                           nb::handle parent) {
  constexpr int64_t kField = (int64_t{1} << 20) - 1;  // records.FIELD_MASK
  nb::object seq = nb::steal(PySequence_Fast(hashes.ptr(), "hashes must be a sequence"));
  if (!seq.is_valid()) throw nb::python_error();
  const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  size_t i = first;
  int64_t at_end = 0;
  bool has_end = !end.is_none();
  if (has_end) at_end = PyLong_AsLongLong(end.ptr());
  if (at_end == -1 && PyErr_Occurred()) throw nb::python_error();
  uint64_t par = 0;
  bool has_parent = !parent.is_none();
  nb::object parent_obj = nb::borrow(parent);
  size_t added = 0;
  Py_buffer buf;  // the packed token ids: bytes, or a memoryview of the payload's
  if (PyObject_GetBuffer(packed.ptr(), &buf, PyBUF_SIMPLE) < 0) throw nb::python_error();
  struct Release {
    Py_buffer* b;
    ~Release() { PyBuffer_Release(b); }
  } release{&buf};
  const bool plain = !meta.spilled() && !cpu.spilled() && !storage.spilled() && size > 0 &&
                     size <= kField && unit > 0 && size % unit == 0 && off >= 0 &&
                     (!has_end || at_end >= 0) &&
                     (!has_parent || hash_fits(parent.ptr(), par)) &&
                     static_cast<size_t>(buf.len) >=
                         static_cast<size_t>(off + static_cast<int64_t>(n) * size) * 8;
  if (plain) {
    const int64_t* tokens = static_cast<const int64_t*>(buf.buf);
    kvn::RecordTable& t = meta.table();
    for (; i < n; ++i) {
      uint64_t h;
      if (!hash_fits(items[i], h) || t.find(h)) break;
      int64_t end_field = 0;  // end in blocks + 1 (0: unknown)
      if (has_end) {
        const int64_t e = (at_end + size) / size;
        if (e >= kField) break;  // records.packs_end
        end_field = e + 1;
      }
      const uint64_t ck = kvn::chain_units(key, tokens + off + static_cast<int64_t>(i) * size,
                                           static_cast<size_t>(size / unit),
                                           static_cast<size_t>(unit));
      // records.pack: bits 0-63 the key, 64 "has a key", 65-84 end + 1, 85-104 size,
      // 105-169 parent + 1, 171 up the GPU refcount (one)
      const uint64_t p_lo = has_parent ? par + 1 : 0;
      const uint64_t p_hi = has_parent && par == ~uint64_t{0} ? 1 : 0;  // bit 64 of parent + 1
      uint64_t w[3];
      w[0] = ck;
      w[1] = uint64_t{1} | static_cast<uint64_t>(end_field) << 1 |
             static_cast<uint64_t>(size) << 21 | p_lo << 41;
      w[2] = p_lo >> 23 | p_hi << 41 | uint64_t{1} << 43;
      t.set(h, w);
      marks.mark(ck, slot);
      if (!cpu.table().find(h) && !storage.table().find(h)) ++added;
      key = ck;
      if (has_end) at_end += size;
      par = h;
      has_parent = true;
      parent_obj = nb::borrow(items[i]);
    }
  }
  nb::object end_out = has_end ? nb::steal(PyLong_FromLongLong(at_end)) : nb::none();
  return nb::make_tuple(i, key, end_out, parent_obj, added);
}

// GPU removals of one group, by the rules of kvevents.consumers.index.refs.RefRules.remove
// for the GPU tier while the group keeps no eviction bookkeeping (no resident-children
// counts, nothing deferred): each hash's record loses one GPU reference; the last one
// unmarks its content key and, when no CPU/STORAGE refcount holds it, ends its residency.
// A hash without a record or GPU reference is an unknown removal.  Returns (removed,
// unknown, residencies ended, the hashes whose records are now retained, in order).
nb::tuple gpu_remove_run(RecordTableObj& meta, const RecordTableObj& cpu,
                         const RecordTableObj& storage, kvn::SlotMarks& marks, uint32_t slot,
                         nb::handle hashes) {
  if (meta.spilled() || cpu.spilled() || storage.spilled())
    throw nb::value_error("gpu_remove_run: the tables must be native");
  nb::object seq = nb::steal(PySequence_Fast(hashes.ptr(), "hashes must be a sequence"));
  if (!seq.is_valid()) throw nb::python_error();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  kvn::RecordTable& t = meta.table();
  size_t removed = 0, unknown = 0, ended = 0;
  nb::list retire;
  constexpr uint64_t kOne = uint64_t{1} << 43;  // one GPU reference (bit 171) in word 2
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint64_t h;
    const uint64_t* found = hash_fits(items[i], h) ? t.find(h) : nullptr;
    const uint64_t count = found ? found[2] >> 43 : 0;
    if (!count) {
      ++unknown;
      continue;
    }
    ++removed;
    uint64_t w[3] = {found[0], found[1], found[2] - kOne};
    t.set(h, w);
    if (count > 1) continue;
    if (w[1] & 1) marks.unmark(w[0], slot);  // (bit 64: it has a content key)
    if (cpu.table().find(h) || storage.table().find(h)) continue;
    ++ended;
    retire.append(nb::borrow(items[i]));
  }
  return nb::make_tuple(removed, unknown, ended, retire);
}

int record_table_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  return nb::inst_ptr<RecordTableObj>(self)->traverse(visit, arg);
}

int record_table_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<RecordTableObj>(self)->drop_spill();
  return 0;
}

PyType_Slot record_table_slots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(record_table_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(record_table_clear)},
    {0, nullptr}};

// --- Lookups: kvn::Lookup over many plans (kvevents.consumers.router.lookup) ---------

// an attribute of ``o`` as a new reference
nb::object attr(nb::handle o, const char* name) { return nb::getattr(o, name); }

int64_t attr_i64(nb::handle o, const char* name) { return nb::cast<int64_t>(attr(o, name)); }

// the slots of a non-negative bitset
std::vector<uint32_t> slots_of_bits(nb::handle bits) {
  kvn::SlotMarks::Words w = words_of_int(bits);
  std::vector<uint32_t> out;
  for (size_t j = 0; j < w.size(); ++j) {
    uint64_t x = w[j];
    while (x) {
      out.push_back(static_cast<uint32_t>(j * 64 + static_cast<size_t>(__builtin_ctzll(x))));
      x &= x - 1;
    }
  }
  return out;
}

// The plans of many workers, bound once (per layout), and their lookups per request.
class Lookups {
 public:
  Lookups(nb::handle plans, nb::object match_type) : match_(std::move(match_type)) {
    if (!PyType_Check(match_.ptr()) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(match_.ptr()), &PyTuple_Type))
      throw nb::type_error("Lookups: the match type must be a tuple type");
    for (nb::handle plan : nb::iter(plans)) {
      if (!attr(plan, "blocked").is_none()) continue;  // never credited
      if (attr_i64(plan, "lookahead") != 0)
        throw nb::value_error("Lookups: a plan with lookahead (looked up in Python)");
      kvn::Plan p;
      p.unitary = nb::cast<bool>(attr(plan, "unitary"));
      p.align = attr_i64(plan, "align");
      p.windowed = nb::cast<bool>(attr(plan, "windowed"));
      p.bpc = attr_i64(plan, "bpc");
      p.eagle = nb::cast<bool>(attr(plan, "eagle"));
      if (p.align <= 0 || p.bpc < 0) throw nb::value_error("Lookups: align or bpc out of range");
      for (nb::handle sg : nb::iter(attr(plan, "spec_groups"))) {
        kvn::SpecGroup g;
        std::string cls = nb::cast<std::string>(attr(sg, "cls"));
        g.cls = cls == "full"    ? kvn::GroupCls::Full
                : cls == "local" ? kvn::GroupCls::Local
                                 : kvn::GroupCls::Sliding;
        g.block_size = attr_i64(sg, "block_size");
        g.window = attr_i64(sg, "window");
        for (nb::handle s : nb::iter(attr(sg, "slots"))) g.slots.push_back(nb::cast<uint32_t>(s));
        if (slots_of_bits(attr(sg, "bits")) != sorted(g.slots))
          throw nb::value_error("Lookups: a spec group's bits are not its slots");
        if (g.block_size <= 0 || g.slots.empty() || (g.cls != kvn::GroupCls::Full && g.window <= 0))
          throw nb::value_error("Lookups: a spec group without block size, slots or window");
        p.spec_groups.push_back(std::move(g));
      }
      if (p.spec_groups.empty()) throw nb::value_error("Lookups: a plan without spec groups");
      for (nb::handle cg : nb::iter(attr(plan, "chunk_groups"))) {
        nb::tuple t = nb::cast<nb::tuple>(cg);
        if (t.size() != 4) throw nb::value_error("Lookups: a chunk group is (cls, size, wchunks, bit)");
        kvn::ChunkGroup g;
        g.full = nb::cast<std::string>(t[0]) == "full";
        g.block_size = nb::cast<int64_t>(t[1]);
        g.wchunks = nb::cast<int64_t>(t[2]);
        g.slots = slots_of_bits(t[3]);
        if (g.block_size <= 0) throw nb::value_error("Lookups: a chunk group without block size");
        p.chunk_groups.push_back(std::move(g));
      }
      wids_.push_back(nb::borrow(attr(plan, "wid")));
      plans_.push_back(std::move(p));
    }
  }

  size_t len() const { return plans_.size(); }

  // out[wid] = match_type(gpu, cpu, storage) for every plan with anything reusable
  void matches(const kvn::SlotMarks& m0, const kvn::SlotMarks& m1, const kvn::SlotMarks& m2,
               nb::handle keys, int64_t n, int64_t unit, nb::handle prefix, nb::dict out) {
    std::vector<uint64_t> ks;
    {
      nb::object seq = nb::steal(PySequence_Fast(keys.ptr(), "keys must be a sequence"));
      if (!seq.is_valid()) throw nb::python_error();
      const Py_ssize_t nk = PySequence_Fast_GET_SIZE(seq.ptr());
      PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
      ks.resize(static_cast<size_t>(nk));
      for (Py_ssize_t i = 0; i < nk; ++i) {
        ks[static_cast<size_t>(i)] = PyLong_AsUnsignedLongLong(items[i]);
        if (PyErr_Occurred()) throw nb::python_error();
      }
    }
    std::vector<int64_t> pre;
    const bool has_prefix = !prefix.is_none();
    if (has_prefix) {
      nb::object seq = nb::steal(PySequence_Fast(prefix.ptr(), "prefix must be a sequence"));
      if (!seq.is_valid()) throw nb::python_error();
      const Py_ssize_t np = PySequence_Fast_GET_SIZE(seq.ptr());
      PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
      pre.resize(static_cast<size_t>(np));
      for (Py_ssize_t i = 0; i < np; ++i) {
        pre[static_cast<size_t>(i)] = PyLong_AsLongLong(items[i]);
        if (PyErr_Occurred()) throw nb::python_error();
      }
    }
    const kvn::SlotMarks* marks[3] = {&m0, &m1, &m2};
    try {
      kvn::Lookup lookup(marks, ks.data(), ks.size(), n, unit, has_prefix ? pre.data() : nullptr,
                         pre.size());
      PyTypeObject* mt = reinterpret_cast<PyTypeObject*>(match_.ptr());
      for (size_t i = 0; i < plans_.size(); ++i) {
        const kvn::Hit h = lookup.match(plans_[i]);
        if (!(h.gpu || h.cpu || h.storage)) continue;
        kvn::Ref g = kvn::chk(PyLong_FromLongLong(h.gpu));
        kvn::Ref t = kvn::make_match(mt, g.get(), h.cpu, h.storage);  // (as the assembler's)
        if (PyDict_SetItem(out.ptr(), wids_[i].ptr(), t.get()) < 0) throw nb::python_error();
      }
    } catch (const kvn::WalkError&) {
      throw nb::python_error();
    } catch (const std::invalid_argument& e) {
      throw nb::value_error(e.what());
    } catch (const std::out_of_range& e) {
      throw nb::index_error(e.what());
    }
  }

 private:
  static std::vector<uint32_t> sorted(std::vector<uint32_t> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  }

  nb::object match_;
  std::vector<nb::object> wids_;
  std::vector<kvn::Plan> plans_;
};

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "kvevents' compiled core: the wire parser and the content-key kernels.";
  m.attr("__version__") = KVEVENTS_NATIVE_VERSION;
  // an index's SlotMarks may still be alive when the interpreter tears the module down
  // (an index held by a module global): that is not a leak worth a warning at exit
  nb::set_leak_warnings(false);

  nb::class_<ParsedBatch>(m, "ParsedBatch",
                          "One payload read natively: events in flat arrays, no Python "
                          "object per event.")
      .def_prop_ro("ts", &ParsedBatch::ts)
      .def_prop_ro("data_parallel_rank", &ParsedBatch::rank)
      .def_prop_ro("block_events", &ParsedBatch::block_events)
      .def("__len__", &ParsedBatch::len)
      .def("kind", &ParsedBatch::kind, nb::arg("i"))
      .def("event", &ParsedBatch::event, nb::arg("i"))
      .def("block_keys", &ParsedBatch::block_keys, nb::arg("i"), nb::arg("parent"),
           nb::arg("unit"))
      .def("ops", &ParsedBatch::ops,
           "The batch as the index applies it: one tuple per step (see module.cpp).")
      .def("chain_blocks", &ParsedBatch::chain_blocks, nb::arg("i"), nb::arg("start"),
           nb::arg("size"), nb::arg("parent"), nb::arg("unit"), nb::arg("limit"),
           "Chain keys of consecutive blocks of BlockStored ``i`` from token ``start``.");

  nb::class_<kvn::SlotMarks>(
      m, "SlotMarks",
      "A tier's marks (kvevents.consumers.index.marks.TierMarks) in flat tables: content "
      "key -> the slots holding it, counted per (key, slot).  Read like the TierMarks dict "
      "(get, [], in, len, iteration and items in marking order); the walk reads it "
      "without a Python object per key.")
      .def(nb::init<>())
      .def("mark", &kvn::SlotMarks::mark, nb::arg("ck"), nb::arg("slot"),
           "One more reference of ``ck`` by ``slot``.")
      .def("unmark", &kvn::SlotMarks::unmark, nb::arg("ck"), nb::arg("slot"),
           "One reference of ``ck`` by ``slot`` fewer (the slot's bit goes with the last).")
      .def("get", &marks_get, nb::arg("key").none(), nb::arg("default").none() = nb::none(),
           "The bitset of slots holding ``key`` (a bit per slot), or ``default``.")
      .def("__getitem__",
           [](const kvn::SlotMarks& m, nb::handle key) {
             nb::object v = marks_get(m, key, nb::none());
             if (v.is_none()) throw nb::key_error();
             return v;
           },
           nb::arg("key").none())
      .def("__contains__",
           [](const kvn::SlotMarks& m, nb::handle key) {
             uint64_t k;
             return as_key(key, k) && m.contains(k);
           },
           nb::arg("key").none())
      .def("__len__", &kvn::SlotMarks::size)
      .def("__iter__", [](const kvn::SlotMarks& m) { return nb::iter(marks_keys(m)); })
      .def("keys", &marks_keys, "The content keys, in marking order.")
      .def("items", &marks_items, "(key, bitset) pairs, in marking order.")
      .def("dup_items", &marks_dup_items,
           "((key, 1 << slot), extra references) pairs, in the order first counted "
           "(TierMarks.dups).")
      .def(
          "load",
          [](kvn::SlotMarks& m, uint64_t ck, nb::handle bits) { m.load(ck, words_of_int(bits)); },
          nb::arg("ck"), nb::arg("bits"), "Set the holders of ``ck`` to the slots of ``bits``.")
      .def("load_dup", &kvn::SlotMarks::load_dup, nb::arg("ck"), nb::arg("slot"),
           nb::arg("count"), "``count`` extra references of ``ck`` by ``slot``.")
      .def_prop_ro("nbytes", &kvn::SlotMarks::nbytes, "Bytes the tables hold.");

  nb::class_<RecordTableObj>(
      m, "RecordTable", nb::type_slots(record_table_slots),
      "One KV-cache group's metadata records (engine hash -> record, the packed ints of "
      "kvevents.consumers.index.records) or CPU/STORAGE refcounts (hash -> count) in a flat "
      "insertion-ordered table; read and written like the dict it replaces (get, [], in, "
      "del, pop, len, keys/values/items as lists in insertion order, clear).  A hash or record that does not fit (not an int "
      "in [0, 2**64), or not in (0, 2**192)) moves every item to a Python dict, for good.")
      .def(nb::init<>())
      .def("get", &RecordTableObj::get, nb::arg("key").none(),
           nb::arg("default").none() = nb::none())
      .def("__getitem__", &RecordTableObj::getitem, nb::arg("key").none())
      .def("__setitem__", &RecordTableObj::setitem, nb::arg("key").none(), nb::arg("value").none())
      .def("__delitem__", &RecordTableObj::delitem, nb::arg("key").none())
      .def("__contains__", &RecordTableObj::contains, nb::arg("key").none())
      .def(
          "pop",
          [](RecordTableObj& t, nb::args args) {
            if (args.size() < 1 || args.size() > 2)
              throw nb::type_error("pop expected 1 or 2 arguments");
            return t.pop(args[0], args.size() == 2 ? nb::handle(args[1]) : nb::handle());
          },
          "pop(key[, default])")
      .def("__len__", &RecordTableObj::len)
      .def("__iter__", [](const RecordTableObj& t) { return nb::iter(t.listed(0)); })
      .def("keys", [](const RecordTableObj& t) { return t.listed(0); })
      .def("values", [](const RecordTableObj& t) { return t.listed(1); })
      .def("items", [](const RecordTableObj& t) { return t.listed(2); })
      .def("clear", &RecordTableObj::clear)
      .def("isdisjoint", &RecordTableObj::isdisjoint, nb::arg("hashes"),
           "Whether no item of ``hashes`` is a key here.")
      .def("__eq__",
           [](const RecordTableObj& t, nb::handle other) {
             nb::object mine = nb::steal(PyDict_New());
             if (PyDict_MergeFromSeq2(mine.ptr(), t.listed(2).ptr(), 1) < 0)
               throw nb::python_error();
             int r = PyObject_RichCompareBool(mine.ptr(), other.ptr(), Py_EQ);
             if (r < 0) throw nb::python_error();
             return r != 0;
           })
      .def_prop_ro("spilled", &RecordTableObj::spilled,
                   "Whether a Python dict holds the items (something did not fit).")
      .def_prop_ro("nbytes", &RecordTableObj::nbytes, "Bytes the native table holds.");

  nb::class_<RetainedQueueObj>(
      m, "RetainedQueue", nb::type_slots(retained_slots),
      "The index's retained records in order (kvevents.consumers.index.join.Retention: an "
      "OrderedDict of (worker, group, hash) -> None) in a flat table of 16-byte entries; "
      "used like that OrderedDict ([k] = None, pop(k, default), popitem(last=False), in, "
      "len, keys/items as lists oldest first, clear).  A key or value it does not hold "
      "natively moves every item to an OrderedDict, for good.")
      .def(nb::init<>())
      .def("__setitem__", &RetainedQueueObj::setitem, nb::arg("key").none(), nb::arg("value").none())
      .def(
          "pop",
          [](RetainedQueueObj& q, nb::args args) {
            if (args.size() < 1 || args.size() > 2)
              throw nb::type_error("pop expected 1 or 2 arguments");
            return q.pop(args[0], args.size() == 2 ? nb::handle(args[1]) : nb::handle());
          },
          "pop(key[, default])")
      .def("popitem", &RetainedQueueObj::popitem, nb::arg("last") = true)
      .def("__contains__", &RetainedQueueObj::contains, nb::arg("key").none())
      .def("__len__", &RetainedQueueObj::len)
      .def("__iter__", [](const RetainedQueueObj& q) { return nb::iter(q.listed(false)); })
      .def("keys", [](const RetainedQueueObj& q) { return q.listed(false); })
      .def("items", [](const RetainedQueueObj& q) { return q.listed(true); })
      .def("clear", &RetainedQueueObj::clear)
      .def_prop_ro("spilled", &RetainedQueueObj::spilled)
      .def_prop_ro("nbytes", &RetainedQueueObj::nbytes, "Bytes the native table holds.");

  nb::class_<Lookups>(
      m, "Lookups",
      "Many workers' lookup plans (kvevents.consumers.index.LookupPlan, without lookahead; "
      "blocked ones left out), bound once, looked up per request by vLLM's rules "
      "(kvevents.consumers.router.lookup.WorkerLookup), reading the tiers' SlotMarks.")
      .def(nb::init<nb::handle, nb::object>(), nb::arg("plans"), nb::arg("match_type"))
      .def("__len__", &Lookups::len, "The plans bound (blocked ones left out).")
      .def("matches", &Lookups::matches, nb::arg("gpu"), nb::arg("cpu"), nb::arg("storage"),
           nb::arg("keys"), nb::arg("n"), nb::arg("unit"), nb::arg("prefix").none(),
           nb::arg("out"),
           "For a request of ``n`` tokens with unit keys ``keys`` (``unit`` tokens each) "
           "and full_prefix's answer ``prefix`` (or None): out[wid] = match_type(gpu, cpu, "
           "storage) for every plan with anything reusable, in plan order.");

  m.def("gpu_store_blocks", &gpu_store_blocks, nb::arg("meta"), nb::arg("cpu"),
        nb::arg("storage"), nb::arg("marks"), nb::arg("slot"), nb::arg("hashes"),
        nb::arg("first"), nb::arg("packed"), nb::arg("off"), nb::arg("size"), nb::arg("unit"),
        nb::arg("key"), nb::arg("end").none(), nb::arg("parent").none(),
        "The new blocks of a plain GPU store from block ``first``, natively (see module.cpp): "
        "(next block, key, end, parent, entries made resident).");

  m.def("gpu_remove_run", &gpu_remove_run, nb::arg("meta"), nb::arg("cpu"), nb::arg("storage"),
        nb::arg("marks"), nb::arg("slot"), nb::arg("hashes"),
        "GPU removals of one group without eviction bookkeeping, natively (see module.cpp): "
        "(removed, unknown, residencies ended, hashes to retain).");

  m.def("parse_batch", &parse_batch, nb::arg("payload"),
        "Parse one payload frame; None when it is not a shape read natively (malformed "
        "input included): hand it to the Python decoder then.");
  m.def("prompt_keys", &prompt_keys, nb::arg("tokens"), nb::arg("unit"), nb::arg("root"),
        "Content keys of every whole unit of ``tokens`` chained from ``root``.");
  m.def(
      "walk",
      [](nb::handle ks, nb::handle get, int64_t step, int64_t unit, nb::handle first,
         nb::handle starts, nb::handle aligned, nb::handle end, nb::handle pos_bits,
         nb::handle nxt) {
        (void)pos_bits;  // the contract: pos_bits[s + 1] == 1 << s
        PyObject* r = kvn::walk(ks.ptr(), get.ptr(), step, unit, first.ptr(), starts.ptr(),
                                aligned.ptr(), end.ptr(), nxt.ptr(), marks_of_get(get));
        if (!r) throw nb::python_error();
        return nb::steal(r);
      },
      nb::arg("ks"), nb::arg("get"), nb::arg("step"), nb::arg("unit"), nb::arg("first"),
      nb::arg("starts"), nb::arg("aligned"), nb::arg("end"), nb::arg("pos_bits"),
      nb::arg("nxt") = nb::tuple(),
      "The router's prefix walk (kvevents.consumers.router.walk.walk), compiled.");
  m.def(
      "assembler",
      [](nb::object match_type) {
        return nb::cpp_function(
            [match_type](nb::handle lay, nb::handle gpu_end, nb::handle cpu_end,
                         nb::handle storage_end, nb::handle hit) {
              PyObject* r = kvn::assemble(match_type.ptr(), lay.ptr(), gpu_end.ptr(),
                                          cpu_end.ptr(), storage_end.ptr(), hit.ptr());
              if (!r) throw nb::python_error();
              return nb::steal(r);
            },
            nb::arg("lay"), nb::arg("gpu_end"), nb::arg("cpu_end").none(), nb::arg("storage_end").none(),
            nb::arg("hit") = -1);
      },
      nb::arg("match_type"),
      "The router's assembly of matches (kvevents.consumers.router.walk.assemble), "
      "compiled, building ``match_type`` tuples.");
  m.def("chain_units", &chain_units, nb::arg("parent"), nb::arg("tokens"), nb::arg("unit"),
        "The key of the last whole unit of ``tokens`` chained on ``parent``.");
}
