// kvevents-native: the router's answer from per-slot ends, compiled
// (kvevents.consumers.router.walk.assemble).
//
// One job: per worker with a non-zero total, its Match(gpu, cpu, storage), in slot
// order, exactly as the Python function builds it (the sparse path when few slots hit,
// the dense path over every position otherwise), creating a Match only for the workers
// in the answer.  Same contract as the walk: ``hit`` is non-negative or -1 (unknown).
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

#include "walk.hpp"

namespace kvn {

// seq[i], bounds-checked as Python indexing is (an IndexError past the end)
inline PyObject* item(PyObject* seq, Py_ssize_t i, Ref& own) {
  if (PyList_CheckExact(seq) && i >= 0 && i < PyList_GET_SIZE(seq)) return PyList_GET_ITEM(seq, i);
  own = chk(PySequence_GetItem(seq, i));
  return own.get();
}

inline int64_t item_i64(PyObject* seq, Py_ssize_t i) {
  Ref own;
  return as_i64(item(seq, i, own));
}

inline Py_ssize_t length(PyObject* seq) {
  Py_ssize_t n = PySequence_Length(seq);
  if (n < 0) throw WalkError{};
  return n;
}

// Match(g, c, s): a tuple of the NamedTuple type ``match``, untracked by the garbage
// collector; ``g`` is the gpu end object itself (as the Python assembly reuses it), the
// differences are new ints
inline Ref make_match(PyTypeObject* match, PyObject* g, int64_t c, int64_t s) {
  Ref t = chk(match->tp_alloc(match, 3));
  PyObject* b = PyLong_FromLongLong(c);
  PyObject* d = PyLong_FromLongLong(s);
  if (!b || !d) {
    Py_XDECREF(b);
    Py_XDECREF(d);
    throw WalkError{};
  }
  Py_INCREF(g);
  PyTuple_SET_ITEM(t.get(), 0, g);
  PyTuple_SET_ITEM(t.get(), 1, b);
  PyTuple_SET_ITEM(t.get(), 2, d);
  // three ints: nothing for the cycle collector to find (CPython untracks such tuples
  // itself at its next pass); untracked now, a router's burst of answers is never
  // promoted to the older generations, whose full passes walk the whole index
  PyObject_GC_UnTrack(t.get());
  return t;
}

inline PyObject* assemble(PyObject* match_type, PyObject* lay, PyObject* gpu_end, PyObject* cpu_end,
                          PyObject* storage_end, PyObject* hit) {
  try {
    if (!PyType_Check(match_type) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(match_type), &PyTuple_Type)) {
      PyErr_SetString(PyExc_TypeError, "assemble: the match type must be a tuple type");
      throw WalkError{};
    }
    PyTypeObject* mt = reinterpret_cast<PyTypeObject*>(match_type);
    Ref pos_wids = chk(PyObject_GetAttrString(lay, "pos_wids"));
    Ref nslots_o = chk(PyObject_GetAttrString(lay, "nslots"));
    const int64_t nslots = as_i64(nslots_o.get());
    const bool has_cpu = cpu_end != Py_None;
    const bool has_storage = storage_end != Py_None;
    Ref out = chk(PyDict_New());
    // the sparse path: when ``hit`` is known and few of its bits are set
    bool sparse = false;
    std::vector<uint64_t> bits;
    if (!PyLong_Check(hit)) {
      PyErr_SetString(PyExc_TypeError, "assemble: hit must be an int");
      throw WalkError{};
    }
    if (_PyLong_Sign(hit) >= 0) {
      std::vector<unsigned char> scratch;
      read_bits(hit, words_of(hit), bits, scratch);
      int64_t count = 0;
      for (uint64_t w : bits) count += __builtin_popcountll(w);
      sparse = count * 8 < nslots;
    }
    PyObject* c_end = has_cpu ? cpu_end : gpu_end;
    PyObject* s_end = has_storage ? storage_end : c_end;
    if (sparse) {
      for (size_t i = 0; i < bits.size(); ++i) {  // ascending slot order
        uint64_t word = bits[i];
        while (word) {
          int bit = __builtin_ctzll(word);
          word &= word - 1;
          Py_ssize_t p = static_cast<Py_ssize_t>(i * 64 + static_cast<size_t>(bit)) + 1;
          Ref o1, o2;
          PyObject* total_o = item(s_end, p, o1);
          if (!truthy(total_o)) continue;
          PyObject* wid = item(pos_wids.get(), p, o2);
          if (wid == Py_None) continue;
          int64_t total = as_i64(total_o);
          Ref o3;
          PyObject* go = item(gpu_end, p, o3);
          int64_t g = as_i64(go);
          int64_t c = item_i64(c_end, p);
          Ref m = make_match(mt, go, c - g, total - c);
          if (PyDict_SetItem(out.get(), wid, m.get()) < 0) throw WalkError{};
        }
      }
      return out.release();
    }
    // the dense path: every position up to the shortest of the sequences
    Py_ssize_t n = std::min(length(pos_wids.get()), length(gpu_end));
    if (has_cpu) n = std::min(n, length(cpu_end));
    if (has_storage) n = std::min(n, length(storage_end));
    for (Py_ssize_t p = 0; p < n; ++p) {
      Ref o1;
      if (!truthy(item(s_end, p, o1))) continue;
      Ref o2;
      PyObject* wid = item(pos_wids.get(), p, o2);
      Ref o3;
      PyObject* go = item(gpu_end, p, o3);
      int64_t g = as_i64(go);
      int64_t c = has_cpu ? item_i64(cpu_end, p) : g;
      int64_t s = has_storage ? item_i64(storage_end, p) : c;
      Ref m = make_match(mt, go, c - g, s - c);
      if (PyDict_SetItem(out.get(), wid, m.get()) < 0) throw WalkError{};
    }
    return out.release();
  } catch (const WalkError&) {
    return nullptr;
  }
}

}  // namespace kvn
