// jaxstreams.serve's request as the caller makes it: admitted, run and counted
// in the caller's thread. It calls its target (`jax.jit(f)` in direct mode,
// the batcher in grouped mode) and, where `_wait` is set, waits for the result.
//
// A server (or one model's endpoint) is an instance of this type (a Python
// subclass that adds the server's methods), so a call of it is the call below. The
// same object is written in Python in jaxstreams/serving/_direct.py (used
// where this module is not built); that file says what each part is for.
// This one exists for speed: after each execution the interpreter's code and
// data are out of the CPU caches, so every Python step a server adds between a
// caller and jax.jit costs several times what it costs in a tight loop, and a
// Python wrapper with counts cost a measurable share of a batch-1 request on
// CPU. Here that work is a few C statements.
//
// CPython's limited API (3.11), so one build serves every CPython from 3.11.
// It relies on the GIL: the counters change only while it is held (calls into
// jax release it, but no counter changes across such a call), so they need no
// lock. A free-threaded CPython does not load limited-API modules, and the
// Python implementation runs there.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cstddef>

namespace {

struct DirectCall {
  PyObject_HEAD
  PyObject* target;        // jax.jit(f), or the batcher's call (settable)
  PyObject* array_type;    // jax.Array's concrete type: one array, one wait
  PyObject* block_tree;    // jax.block_until_ready, for any other output
  PyObject* admit_slowly;  // the server's locked way: refuses, or waits for room
  PyObject* wake;          // wakes callers waiting for room or a close
  PyObject* block_name;    // "block_until_ready"
  Py_ssize_t running;      // requests holding a token
  Py_ssize_t finished;     // requests that returned or raised
  Py_ssize_t failed;       // of those, the ones that raised
  Py_ssize_t admit_limit;  // most requests admitted without admit_slowly
  char must_wake;          // call wake when a request ends
  char wait;               // wait for the target's result (settable)
};

PyObject* CallNoArgs(PyObject* callable) {
  return PyObject_CallFunctionObjArgs(callable, nullptr);
}

// Calls wake() after a request ended with `out` (nullptr: with an error set).
// Keeps the request's own error; an error of wake() replaces a result.
PyObject* Wake(DirectCall* self, PyObject* out) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* woke = CallNoArgs(self->wake);
  if (woke != nullptr) {
    Py_DECREF(woke);
    PyErr_Restore(type, value, traceback);
    return out;
  }
  if (out == nullptr) {  // the request's error goes on; wake()'s is reported
    PyErr_WriteUnraisable(self->wake);
    PyErr_Restore(type, value, traceback);
    return nullptr;
  }
  Py_DECREF(out);
  return nullptr;
}

PyObject* DirectCallCall(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<DirectCall*>(obj);
  if (self->target == nullptr) {  // made by __new__ alone
    PyErr_SetString(PyExc_TypeError, "DirectCall: not initialized");
    return nullptr;
  }
  if (self->running < self->admit_limit) {
    ++self->running;
  } else {
    PyObject* admitted = CallNoArgs(self->admit_slowly);
    if (admitted == nullptr) return nullptr;  // refused: holds no token
    Py_DECREF(admitted);                      // admitted: holds a token
  }
  // The target and the flag as this request found them: another thread may
  // replace the target while this call runs inside it (the GIL is released
  // in jax), so the call holds a reference of its own.
  PyObject* target = self->target;
  const char wait = self->wait;
  Py_INCREF(target);
  PyObject* out = PyObject_Call(target, args, kwargs);
  Py_DECREF(target);
  if (out != nullptr && wait) {
    PyObject* ready =
        Py_TYPE(out) == reinterpret_cast<PyTypeObject*>(self->array_type)
            ? PyObject_CallMethodObjArgs(out, self->block_name, nullptr)
            : PyObject_CallFunctionObjArgs(self->block_tree, out, nullptr);
    if (ready != nullptr) {
      Py_DECREF(ready);
    } else {
      Py_CLEAR(out);
    }
  }
  --self->running;
  ++self->finished;
  if (out == nullptr) ++self->failed;
  return self->must_wake ? Wake(self, out) : out;
}

int DirectCallInit(PyObject* obj, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"target", "array_type", "block_tree",
                                   "admit_slowly", "wake", nullptr};
  auto* self = reinterpret_cast<DirectCall*>(obj);
  PyObject *target, *array_type, *block_tree, *admit_slowly, *wake;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO:DirectCall",
                                   const_cast<char**>(keywords), &target,
                                   &array_type, &block_tree, &admit_slowly,
                                   &wake)) {
    return -1;
  }
  if (!PyType_Check(array_type)) {
    PyErr_SetString(PyExc_TypeError, "DirectCall: array_type must be a type");
    return -1;
  }
  if (self->target != nullptr) {  // __init__ again would reset the counts
    PyErr_SetString(PyExc_TypeError, "DirectCall: already initialized");
    return -1;
  }
  self->block_name = PyUnicode_InternFromString("block_until_ready");
  if (self->block_name == nullptr) return -1;
  Py_INCREF(target);
  self->target = target;
  Py_INCREF(array_type);
  self->array_type = array_type;
  Py_INCREF(block_tree);
  self->block_tree = block_tree;
  Py_INCREF(admit_slowly);
  self->admit_slowly = admit_slowly;
  Py_INCREF(wake);
  self->wake = wake;
  self->admit_limit = PY_SSIZE_T_MAX;
  self->wait = 1;
  return 0;
}

int DirectCallTraverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<DirectCall*>(obj);
  Py_VISIT(Py_TYPE(obj));  // a heap type: its instances hold it
  Py_VISIT(self->target);
  Py_VISIT(self->array_type);
  Py_VISIT(self->block_tree);
  Py_VISIT(self->admit_slowly);
  Py_VISIT(self->wake);
  return 0;
}

int DirectCallClear(PyObject* obj) {
  auto* self = reinterpret_cast<DirectCall*>(obj);
  Py_CLEAR(self->target);
  Py_CLEAR(self->array_type);
  Py_CLEAR(self->block_tree);
  Py_CLEAR(self->admit_slowly);
  Py_CLEAR(self->wake);
  Py_CLEAR(self->block_name);
  return 0;
}

void DirectCallDealloc(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  PyObject_GC_UnTrack(obj);
  DirectCallClear(obj);
  auto free_fn = reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free));
  free_fn(obj);
  Py_DECREF(type);
}

// Token bookkeeping for the server's locked way (admission after a refusal or
// a wait, submit()); the call above does the same inline.
PyObject* DirectCallTake(PyObject* obj, PyObject* limit_arg) {
  auto* self = reinterpret_cast<DirectCall*>(obj);
  Py_ssize_t limit = PyLong_AsSsize_t(limit_arg);
  if (limit == -1 && PyErr_Occurred()) return nullptr;
  if (self->running >= limit) Py_RETURN_FALSE;
  ++self->running;
  Py_RETURN_TRUE;
}

PyObject* DirectCallRelease(PyObject* obj, PyObject*) {
  --reinterpret_cast<DirectCall*>(obj)->running;
  Py_RETURN_NONE;
}

PyObject* DirectCallFinish(PyObject* obj, PyObject* ok_arg) {
  auto* self = reinterpret_cast<DirectCall*>(obj);
  int ok = PyObject_IsTrue(ok_arg);
  if (ok < 0) return nullptr;
  --self->running;
  ++self->finished;
  if (!ok) ++self->failed;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"_take", DirectCallTake, METH_O,
     "_take(limit) -> bool: a token if fewer than limit are running."},
    {"_release", DirectCallRelease, METH_NOARGS,
     "_release(): gives back a token of a request that did not run."},
    {"_finish", DirectCallFinish, METH_O,
     "_finish(ok): gives back a token of a request that ran; counts it."},
    {nullptr, nullptr, 0, nullptr},
};

PyMemberDef kMembers[] = {
    {"_running", T_PYSSIZET, offsetof(DirectCall, running), READONLY, nullptr},
    {"_finished", T_PYSSIZET, offsetof(DirectCall, finished), READONLY, nullptr},
    {"_failed", T_PYSSIZET, offsetof(DirectCall, failed), READONLY, nullptr},
    {"_admit_limit", T_PYSSIZET, offsetof(DirectCall, admit_limit), 0, nullptr},
    {"_must_wake", T_BOOL, offsetof(DirectCall, must_wake), 0, nullptr},
    {"_wait", T_BOOL, offsetof(DirectCall, wait), 0, nullptr},
    {"_target", T_OBJECT_EX, offsetof(DirectCall, target), 0, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyType_Slot kSlots[] = {
    {Py_tp_doc, const_cast<char*>(
        "DirectCall(target, array_type, block_tree, admit_slowly, wake): "
        "a request of jaxstreams.serve (see "
        "jaxstreams/serving/_direct.py).")},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_init, reinterpret_cast<void*>(DirectCallInit)},
    {Py_tp_call, reinterpret_cast<void*>(DirectCallCall)},
    {Py_tp_traverse, reinterpret_cast<void*>(DirectCallTraverse)},
    {Py_tp_clear, reinterpret_cast<void*>(DirectCallClear)},
    {Py_tp_dealloc, reinterpret_cast<void*>(DirectCallDealloc)},
    {Py_tp_methods, kMethods},
    {Py_tp_members, kMembers},
    {0, nullptr},
};

PyType_Spec kSpec = {
    "jaxstreams.serving._serve_direct.DirectCall",
    sizeof(DirectCall),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    kSlots,
};

int Exec(PyObject* module) {
  PyObject* type = PyType_FromSpec(&kSpec);
  if (type == nullptr) return -1;
  int rc = PyModule_AddObjectRef(module, "DirectCall", type);
  Py_DECREF(type);
  return rc;
}

PyModuleDef_Slot kModuleSlots[] = {
    {Py_mod_exec, reinterpret_cast<void*>(Exec)},
    {0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_serve_direct",
    "jaxstreams.serve's direct-mode request in C.", 0, nullptr, kModuleSlots,
    nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__serve_direct(void) { return PyModuleDef_Init(&kModule); }
