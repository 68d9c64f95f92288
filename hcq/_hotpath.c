/* hcq._hotpath: the optional CPython extension of the launch hot path (built by the package's build step;
 * where it cannot be built, hcq falls back to ctypes and behaves the same, only slower).
 *
 * submitter(address) wraps an executor's native submit function,
 *     int submit(void *ring, const uint64_t *words, uint64_t nwords, int64_t timeout_ns)
 * as a Python callable submit(ring, words_address, nwords, timeout_ns) -> int: the call ctypes makes, without
 * ctypes' argument conversion. The GIL is released around the native call, as ctypes does: a submission may
 * wait for ring room. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*submit_fn)(void *ring, const uint64_t *words, uint64_t nwords, int64_t timeout_ns);

static PyObject *hot_submit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "submit(ring, words_address, nwords, timeout_ns) takes 4 arguments, got %zd", nargs);
    return NULL;
  }
  submit_fn fn = (submit_fn)PyLong_AsVoidPtr(self);
  void *ring = PyLong_AsVoidPtr(args[0]);
  const uint64_t *words = (const uint64_t *)PyLong_AsVoidPtr(args[1]);
  unsigned long long n = PyLong_AsUnsignedLongLong(args[2]);
  long long timeout_ns = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return NULL;
  if (ring == NULL || words == NULL) {
    PyErr_SetString(PyExc_ValueError, "submit: ring and words_address must be non-zero addresses");
    return NULL;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = fn(ring, words, (uint64_t)n, (int64_t)timeout_ns);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

static PyMethodDef submit_def = {"submit", (PyCFunction)(void (*)(void))hot_submit, METH_FASTCALL,
                                 "submit(ring, words_address, nwords, timeout_ns) -> status"};

static PyObject *submitter(PyObject *module, PyObject *address) {
  void *fn = PyLong_AsVoidPtr(address);
  if (fn == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "submitter: the function address is 0");
    return NULL;
  }
  PyObject *self = PyLong_FromVoidPtr(fn);
  if (self == NULL) return NULL;
  PyObject *f = PyCFunction_NewEx(&submit_def, self, module);
  Py_DECREF(self);
  return f;
}

static PyMethodDef methods[] = {
  {"submitter", submitter, METH_O, "submitter(address) -> submit(ring, words_address, nwords, timeout_ns) -> status"},
  {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "hcq._hotpath", "hcq's launch hot path (optional)", -1, methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hotpath(void) { return PyModule_Create(&module_def); }
