// kvevents-native: the router's prefix walk, compiled (kvevents.consumers.router.walk.walk).
//
// One job: the same walk as the Python function, step for step, over the same Python
// objects (bitsets are Python ints, the marks a dict or any ``get(key, default)``
// callable), so it is a drop-in for it.  It saves the interpreter's work per key: a dict
// lookup, an AND and a compare per key, and per run end a loop over the bits that drop
// out done on the int's bytes instead of one bit_length() per bit.  The one assumption
// beyond the Python function's arguments is its documented contract: bitsets are
// non-negative and ``pos_bits[s + 1] == 1 << s``.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "marks.hpp"

namespace kvn {

// An owned reference, released on scope exit.
class Ref {
 public:
  Ref() = default;
  explicit Ref(PyObject* o) : o_(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& r) noexcept : o_(r.o_) { r.o_ = nullptr; }
  Ref& operator=(Ref&& r) noexcept {
    if (this != &r) {
      Py_XDECREF(o_);
      o_ = r.o_;
      r.o_ = nullptr;
    }
    return *this;
  }
  ~Ref() { Py_XDECREF(o_); }
  PyObject* get() const { return o_; }
  PyObject* release() {
    PyObject* o = o_;
    o_ = nullptr;
    return o;
  }
  explicit operator bool() const { return o_ != nullptr; }

 private:
  PyObject* o_ = nullptr;
};

struct WalkError {};  // a Python exception is set

inline Ref chk(PyObject* o) {
  if (!o) throw WalkError{};
  return Ref(o);
}

inline bool truthy(PyObject* o) {  // a non-zero int
  int t = PyObject_IsTrue(o);
  if (t < 0) throw WalkError{};
  return t != 0;
}

inline Ref band(PyObject* a, PyObject* b) { return chk(PyNumber_And(a, b)); }
inline Ref bor(PyObject* a, PyObject* b) { return chk(PyNumber_Or(a, b)); }
inline Ref bxor(PyObject* a, PyObject* b) { return chk(PyNumber_Xor(a, b)); }

inline bool ne(PyObject* a, PyObject* b) {
  int r = PyObject_RichCompareBool(a, b, Py_NE);
  if (r < 0) throw WalkError{};
  return r != 0;
}

inline int64_t as_i64(PyObject* o) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw WalkError{};
  return v;
}

class Walker {
 public:
  Walker(PyObject* get, PyObject* end, const SlotMarks* marks) : marks_(marks), end_(end) {
    // a bound dict.get is read with the dict API; anything else is called
    if (PyCFunction_Check(get)) {
      PyObject* self = PyCFunction_GET_SELF(get);
      PyMethodDef* ml = reinterpret_cast<PyCFunctionObject*>(get)->m_ml;
      if (self && PyDict_CheckExact(self) && ml && std::string_view(ml->ml_name) == "get")
        dict_ = self;
    }
    get_ = get;
    zero_ = Ref(PyLong_FromLong(0));
    if (!zero_) throw WalkError{};
  }

  // get(key, 0): a new reference
  Ref lookup(PyObject* key) {
    if (dict_) {
      PyObject* v = PyDict_GetItemWithError(dict_, key);
      if (v) {
        Py_INCREF(v);
        return Ref(v);
      }
      if (PyErr_Occurred()) throw WalkError{};
      Py_INCREF(zero_.get());
      return Ref(zero_.get());
    }
    return chk(PyObject_CallFunctionObjArgs(get_, key, zero_.get(), nullptr));
  }

  PyObject* zero() const { return zero_.get(); }

  // the bitset of key ``k`` as ``words`` words: from the SlotMarks tables directly, or
  // get(k, 0) read into words
  void read_key(PyObject* k, size_t words, std::vector<uint64_t>& out,
                std::vector<unsigned char>& scratch);

  // end[p] = tokens for every set bit p - 1 of ``b`` (pos_bits[p] == 1 << (p - 1)),
  // highest first as the Python loop goes (the order only matters on error)
  void set_ends(const std::vector<uint64_t>& b, PyObject* tok) {
    const bool is_list = PyList_CheckExact(end_);
    const Py_ssize_t n = is_list ? PyList_GET_SIZE(end_) : -1;
    for (size_t i = b.size(); i-- > 0;) {
      uint64_t word = b[i];
      while (word) {
        int bit = 63 - __builtin_clzll(word);
        word &= ~(uint64_t{1} << bit);
        Py_ssize_t pos = static_cast<Py_ssize_t>(i * 64 + static_cast<size_t>(bit)) + 1;
        if (is_list && pos < n) {
          PyObject* old = PyList_GET_ITEM(end_, pos);
          Py_INCREF(tok);
          PyList_SET_ITEM(end_, pos, tok);
          Py_DECREF(old);
        } else {
          Ref idx = chk(PyLong_FromSsize_t(pos));
          if (PyObject_SetItem(end_, idx.get(), tok) < 0) throw WalkError{};
        }
      }
    }
  }

 private:
  PyObject* get_ = nullptr;
  PyObject* dict_ = nullptr;
  const SlotMarks* marks_ = nullptr;
  PyObject* end_;
  Ref zero_;
};

// --- bitsets: Python ints read into 64-bit words ------------------------------------

using Bits = std::vector<uint64_t>;

// The low ``words`` 64-bit words of non-negative int ``o`` (its higher bits are dropped:
// every AND the walk does has an operand no wider than ``words``).
inline void read_bits(PyObject* o, size_t words, Bits& out, std::vector<unsigned char>& scratch) {
  out.assign(words, 0);
  if (!PyLong_Check(o)) {
    PyErr_Format(PyExc_TypeError, "walk: bitsets are ints, got %.80s", Py_TYPE(o)->tp_name);
    throw WalkError{};
  }
  if (_PyLong_Sign(o) < 0) {
    PyErr_SetString(PyExc_ValueError, "walk: bitsets must be non-negative");
    throw WalkError{};
  }
  if (words == 0) return;
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
  // CPython <= 3.11: the int's 30-bit digits, least significant first, read directly
  // (the fast path: one per key of a walk)
  (void)scratch;
  const PyLongObject* v = reinterpret_cast<const PyLongObject*>(o);
  const Py_ssize_t nd = Py_SIZE(o);  // > 0 here (0 for zero)
  size_t bit = 0;
  for (Py_ssize_t i = 0; i < nd; ++i, bit += 30) {
    const uint64_t d = static_cast<uint64_t>(v->ob_digit[i]);
    const size_t w = bit / 64, off = bit % 64;
    if (w >= words) break;
    out[w] |= d << off;
    if (off > 34 && w + 1 < words) out[w + 1] |= d >> (64 - off);
  }
#elif PY_VERSION_HEX >= 0x030D0000
  Py_ssize_t r = PyLong_AsNativeBytes(o, out.data(), static_cast<Py_ssize_t>(words * 8),
                                      Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
  if (r < 0) throw WalkError{};
  (void)scratch;
#else
  size_t nbits = _PyLong_NumBits(o);
  if (nbits == static_cast<size_t>(-1) && PyErr_Occurred()) throw WalkError{};
  size_t nbytes = (nbits + 7) / 8;
  if (nbytes <= words * 8) {
    if (_PyLong_AsByteArray(reinterpret_cast<PyLongObject*>(o),
                            reinterpret_cast<unsigned char*>(out.data()), words * 8, 1, 0) < 0)
      throw WalkError{};
  } else {
    scratch.resize(nbytes);
    if (_PyLong_AsByteArray(reinterpret_cast<PyLongObject*>(o), scratch.data(), nbytes, 1, 0) < 0)
      throw WalkError{};
    std::memcpy(out.data(), scratch.data(), words * 8);
  }
#endif
  // (little-endian words: the target is little-endian, see keys.hpp)
}

inline void Walker::read_key(PyObject* k, size_t words, Bits& out,
                             std::vector<unsigned char>& scratch) {
  if (marks_) {
    out.resize(words);
    uint64_t key = 0;
    bool ok = PyLong_Check(k);
    if (ok) {
      key = PyLong_AsUnsignedLongLong(k);
      if (key == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
        PyErr_Clear();  // no content key equals it: held by nobody
        ok = false;
      }
    }
    if (ok) {
      marks_->read(key, words, out.data());
    } else {
      std::fill(out.begin(), out.end(), 0);
    }
    return;
  }
  Ref vo = lookup(k);
  read_bits(vo.get(), words, out, scratch);
}

inline size_t words_of(PyObject* o) {
  if (!PyLong_Check(o)) {
    PyErr_Format(PyExc_TypeError, "walk: bitsets are ints, got %.80s", Py_TYPE(o)->tp_name);
    throw WalkError{};
  }
  if (_PyLong_Sign(o) < 0) {
    PyErr_SetString(PyExc_ValueError, "walk: bitsets must be non-negative");
    throw WalkError{};
  }
  size_t nbits = _PyLong_NumBits(o);
  if (nbits == static_cast<size_t>(-1) && PyErr_Occurred()) throw WalkError{};
  return (nbits + 63) / 64;
}

inline Ref to_int(const Bits& b) {
  return chk(_PyLong_FromByteArray(reinterpret_cast<const unsigned char*>(b.data()), b.size() * 8,
                                   1, 0));
}

inline bool any(const Bits& b) {
  for (uint64_t w : b)
    if (w) return true;
  return false;
}

// walk(ks, get, step, unit, first, starts, aligned, end, pos_bits, nxt) ->
// (credited, next_starts, next_aligned), the fields of the Python walk's WalkResult (the
// module's named_walk names them): see kvevents.consumers.router.walk.walk, whose
// contract this follows step for step: the joins (``first`` at the first key, ``starts[j]``
// at the key ending at unit j), the AND per key, and at each run end the credit rule, then the
// per-slot ends and the next tier's starts (the Python records the runs and does these two
// after the walk: _write_ends, _next_tier; the same writes and the same answer).  With one next-tier class
// (the usual fleet) its chunk boundary is tracked as the walk goes (``pend``); the result
// is the Python's per-class rule.
inline PyObject* walk(PyObject* ks, PyObject* get, int64_t step, int64_t unit, PyObject* first,
                      PyObject* starts, PyObject* aligned, PyObject* end, PyObject* nxt,
                      const SlotMarks* marks = nullptr) {
  try {
    Walker w(get, end, marks);
    std::vector<unsigned char> scratch;
    const int has_starts_i = PyObject_IsTrue(starts);
    if (has_starts_i < 0) throw WalkError{};
    const bool has_starts = has_starts_i != 0;
    // the starts (position -> slots), and the widest bitset a slot can come from
    std::vector<std::pair<int64_t, PyObject*>> start_items;  // borrowed from ``items``
    Ref items;
    size_t words = words_of(first);
    if (has_starts) {
      items = chk(PyMapping_Items(starts));
      Py_ssize_t n = PyList_GET_SIZE(items.get());
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* kv = PyList_GET_ITEM(items.get(), i);
        PyObject* bits = PyTuple_GET_ITEM(kv, 1);
        words = std::max(words, words_of(bits));
        start_items.emplace_back(as_i64(PyTuple_GET_ITEM(kv, 0)), bits);
      }
      std::stable_sort(start_items.begin(), start_items.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    Bits first_b;
    read_bits(first, words, first_b, scratch);
    const bool has_first = any(first_b) || words_of(first) > 0;
    // the joins, sorted by position (the Python's _joins)
    std::vector<std::pair<int64_t, Bits>> joins;
    std::vector<std::pair<int64_t, Bits>> start_bits;  // for the credit rule, by position
    if (has_starts) {
      for (auto& [pos, obj] : start_items) {
        Bits b;
        read_bits(obj, words, b, scratch);
        start_bits.emplace_back(pos, b);
        joins.emplace_back(pos, std::move(b));
      }
      if (has_first) {
        if (joins[0].first == step) {
          for (size_t i = 0; i < words; ++i) joins[0].second[i] |= first_b[i];
        } else {
          joins.insert(joins.begin(), std::make_pair(step, first_b));
        }
      }
    } else if (has_first) {
      joins.emplace_back(step, first_b);
    } else {
      Ref nstarts = chk(PyDict_New());
      return Py_BuildValue("(iNi)", 0, nstarts.release(), 0);
    }
    Bits not_aligned;
    read_bits(aligned, words, not_aligned, scratch);
    for (auto& x : not_aligned) x = ~x;
    // the next tier's chunk classes
    int64_t nv = 0;
    Bits nmask(words, 0);
    std::vector<std::pair<int64_t, Bits>> many;
    {
      Ref seq = chk(PySequence_Fast(nxt, "nxt must be a sequence"));
      Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
      PyObject** its = PySequence_Fast_ITEMS(seq.get());
      for (Py_ssize_t i = 0; i < n; ++i) {
        Ref pair = chk(PySequence_Tuple(its[i]));
        if (PyTuple_GET_SIZE(pair.get()) != 2) {
          PyErr_SetString(PyExc_ValueError, "walk: nxt holds (units, mask) pairs");
          throw WalkError{};
        }
        Bits m;
        read_bits(PyTuple_GET_ITEM(pair.get(), 1), words, m, scratch);
        many.emplace_back(as_i64(PyTuple_GET_ITEM(pair.get(), 0)), std::move(m));
      }
      if (many.size() == 1) {
        nv = many[0].first;
        nmask = std::move(many[0].second);
        many.clear();
      }
    }
    std::vector<std::pair<int64_t, Bits>> nstarts;  // in insertion order, as the dict
    auto nstarts_or = [&](int64_t f, const Bits& cb) {
      for (auto& [pos, b] : nstarts)
        if (pos == f) {
          for (size_t i = 0; i < words; ++i) b[i] |= cb[i];
          return;
        }
      nstarts.emplace_back(f, cb);
    };
    size_t it = 0;
    int64_t nj = joins[0].first - step;
    const Bits zero(words, 0);
    const Bits* newbits = &joins[0].second;
    ++it;
    const bool check = has_starts;
    int64_t nfirst = nv;
    Bits pend(words, 0), naligned(words, 0), alive(words, 0), credited(words, 0);
    Bits v, now(words, 0), b(words, 0), cb(words, 0);
    bool alive_any = false;
    int64_t e = 0;
    size_t sidx = 0;  // start_bits[sidx] is the first start at or after e
    Ref seq = chk(PySequence_Fast(ks, "ks must be a sequence"));
    const Py_ssize_t nk = PySequence_Fast_GET_SIZE(seq.get());
    PyObject** keys = PySequence_Fast_ITEMS(seq.get());
    for (Py_ssize_t ki = 0; ki <= nk; ++ki) {
      const bool join_here = e == nj;
      if (alive_any || join_here) {
        PyObject* k = ki < nk ? keys[ki] : Py_None;  // the sentinel: held by nobody
        w.read_key(k, words, v, scratch);
        bool changed = false;
        for (size_t i = 0; i < words; ++i) {
          now[i] = alive[i] & v[i];
          b[i] = alive[i] ^ now[i];
          changed |= b[i] != 0;
        }
        if (changed || join_here) {
          if (join_here) {
            for (size_t i = 0; i < words; ++i) {
              uint64_t got = (*newbits)[i] & v[i];
              now[i] |= got;
              credited[i] |= got;
            }
            if (it < joins.size()) {
              nj = joins[it].first;
              newbits = &joins[it].second;
              ++it;
            } else {
              nj = 0;
              newbits = &zero;
            }
            nj -= step;
          }
          alive.swap(now);
          alive_any = any(alive);
          if (changed) {  // runs end at e (the Python's ``runs[e]``)
            if (check) {  // the credit rule
              while (sidx < start_bits.size() && start_bits[sidx].first < e) ++sidx;
              if (sidx < start_bits.size() && start_bits[sidx].first == e) {
                const Bits& st = start_bits[sidx].second;
                for (size_t i = 0; i < words; ++i) {
                  uint64_t lost = b[i] & st[i] & not_aligned[i];
                  credited[i] ^= lost;
                  b[i] ^= lost;
                }
              }
            }
            if (nv) {  // the next tier's starts: one class
              if (e >= nfirst) {
                if (any(pend)) {
                  nstarts_or(nfirst, pend);
                  std::fill(pend.begin(), pend.end(), 0);
                }
                nfirst = (e / nv + 1) * nv;  // e >= 0, nv > 0 (the Python's floor division)
              }
              const bool al = e == nfirst - nv;
              for (size_t i = 0; i < words; ++i) {
                uint64_t c = b[i] & nmask[i];
                pend[i] |= c;
                if (al) naligned[i] |= c;
              }
            } else if (!many.empty()) {  // several classes
              for (auto& [vv, mask] : many) {
                bool anyc = false;
                for (size_t i = 0; i < words; ++i) {
                  cb[i] = b[i] & mask[i];
                  anyc |= cb[i] != 0;
                }
                if (anyc) {
                  nstarts_or((e / vv + 1) * vv, cb);
                  if (e % vv == 0)
                    for (size_t i = 0; i < words; ++i) naligned[i] |= cb[i];
                }
              }
            }
            if (any(b)) {  // the per-slot ends
              Ref tok = chk(PyLong_FromLongLong(e * unit));
              w.set_ends(b, tok.get());
            }
          }
        }
      }
      if (nj < 0 && !alive_any) break;
      e += step;
    }
    if (any(pend)) nstarts_or(nfirst, pend);
    Ref out_starts = chk(PyDict_New());
    for (auto& [pos, bits] : nstarts) {
      Ref k = chk(PyLong_FromLongLong(pos));
      Ref val = to_int(bits);
      if (PyDict_SetItem(out_starts.get(), k.get(), val.get()) < 0) throw WalkError{};
    }
    Ref c = to_int(credited);
    Ref a = to_int(naligned);
    return PyTuple_Pack(3, c.get(), out_starts.get(), a.get());
  } catch (const WalkError&) {
    return nullptr;
  }
}

}  // namespace kvn
