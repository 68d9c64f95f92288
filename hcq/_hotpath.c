/* hcq._hotpath: the optional CPython extension of the hot paths, built by the package's build step. It runs plans the
 * checked Python path built (see docs/design.md, "One definition of each rule"); where it cannot be built, hcq runs
 * the same plans through Python and ctypes (hcq/packet_queue.py's FastLauncher, hcq/graph.py's _fast_patch), only
 * slower; HCQ_HOTPATH=0 forces that.
 *
 * DeviceState: what the native paths need of one device (HCQCompiled.native_state): a view of its state words
 *   (hcq/device_state.py), its busy set, the device.
 * Launchable: the base type of hcq.HCQProgram. Calling a program, `prg(*bufs, global_size=, local_size=, vals=)`,
 *   enters its tp_call here. It runs the program's LaunchPlan (read once): for a call the plan takes (its arguments
 *   as KernargsLayout.accepts states, no wait, nothing capturing, profiling or validating, the device open, room in
 *   the compute ring) the kernargs are packed into a block of the kernargs ring (hcq/timeline_ring.h), the
 *   plan's words patched on the stack where the plan says and handed to the executor's native submit, and the
 *   timeline steps. Anything else calls `prg.launch(...)`, the checked path, with the same arguments; nothing is
 *   submitted before that decision, so the checked path sees the device as the caller left it.
 * Launcher: what launches need of one device (made by FastLauncher): its DeviceState, the native submit function and
 *   the compute ring's handle, where the kernargs buffer is for the host and for the device, the kernargs ring.
 * Resubmit, GraphRun: a built queue's re-submit; a one-queue graph's replay under its RunPlan. Each advances the ring's
 *   count and the queue's last fence words (hcq/lifetimes.py's Ring) and holds the queue's keepalive itself.
 * submitter(address), waiter(address): an executor's native submit, a backend's native host wait, as Python callables
 *   (queue submissions and signal waits use them).
 * host_copy(dst, src): hcq/hostcopy.h's copy between two host buffers (the allocator's host-side copies).
 * timeline_ring_take(...): hcq/timeline_ring.h's take, for TimelineRing.alloc (hcq/timeline_ring.py).
 * HostCopier: an allocator's copyin or copyout; a small host copy on an idle device in one call, else the method.
 *
 * Threads: everything before the submit runs holding the GIL (so a launch reads and advances the kernargs ring and
 * the program's words as one step); the words go to the submit from this call's stack, and the GIL is released
 * around the submit, which may wait for ring room. Ctrl-C: a Python signal handler runs only between bytecodes, and
 * between the submit and the timeline step no Python code runs, so a launch is never split. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <time.h>
#include <string.h>
#include "hostcopy.h"
#include "timeline_ring.h"
#include "hcq_device_state.h"  /* hcq.device_state.c_header(), written by setup.py: DS_* */
#include "hcq_graph_state.h"  /* hcq.graph_state.c_header(), written by setup.py: GS_* */
#include "hcq_packets.h"  /* hcq.packets.c_header(), written by setup.py: POISON_*, hcq_is_poisoned, hcq_clear_poison */

typedef int (*submit_fn)(void *ring, const uint64_t *words, uint64_t nwords, int64_t timeout_ns);

enum { SUBMIT_OK = 0, MAX_WORDS = 32, MAX_PARAMS = 64, MAX_KERNARGS = 1024 };
static int64_t SUBMIT_SLICE_NS = 20000000;  /* hcq.packet_queue.SUBMIT_SLICE_NS, which it sets (set_submit_slice) */

/* ------------------------------------------------------------------------------------------------ submitter */
static PyObject *submit_function(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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

typedef int (*wait_fn)(const void *addr, uint64_t value, int64_t timeout_ns);

/* wait(addr, value, timeout_ns) -> status: a backend's native host wait (0: the 64-bit word at addr reached value). */
static PyObject *native_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "wait(address, value, timeout_ns) takes 3 arguments, got %zd", nargs);
    return NULL;
  }
  wait_fn fn = (wait_fn)PyLong_AsVoidPtr(self);
  const void *addr = PyLong_AsVoidPtr(args[0]);
  unsigned long long value = PyLong_AsUnsignedLongLong(args[1]);
  long long timeout_ns = PyLong_AsLongLong(args[2]);
  if (PyErr_Occurred()) return NULL;
  if (addr == NULL) {
    PyErr_SetString(PyExc_ValueError, "wait: the address must be non-zero");
    return NULL;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = fn(addr, (uint64_t)value, (int64_t)timeout_ns);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

static PyMethodDef submit_def = {"submit", (PyCFunction)(void (*)(void))submit_function, METH_FASTCALL,
                                 "submit(ring, words_address, nwords, timeout_ns) -> status"};
static PyMethodDef wait_def = {"wait", (PyCFunction)(void (*)(void))native_wait, METH_FASTCALL, "wait(address, value, timeout_ns) -> status"};

/* A Python callable over the native function at `address` (its address is the callable's self). */
static PyObject *wrap_native(PyObject *module, PyObject *address, PyMethodDef *def, const char *what) {
  void *fn = PyLong_AsVoidPtr(address);
  if (fn == NULL) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: the function address is 0", what);
    return NULL;
  }
  PyObject *self = PyLong_FromVoidPtr(fn);
  if (self == NULL) return NULL;
  PyObject *f = PyCFunction_NewEx(def, self, module);
  Py_DECREF(self);
  return f;
}

static PyObject *submitter(PyObject *module, PyObject *address) { return wrap_native(module, address, &submit_def, "submitter"); }
static PyObject *waiter(PyObject *module, PyObject *address) { return wrap_native(module, address, &wait_def, "waiter"); }

/* ------------------------------------------------------------------------------------------------ names and gates */
static PyObject *s_global_size, *s_local_size, *s_vals, *s_wait, *s_timeout, *s_launch, *s_native_plan, *s_dims_words,
    *s_timeline_signal, *s_value_addr, *s_root,
    *s_freed, *s_readonly, *s_owner, *s_va_addr, *s_state, *s_seg_tags, *s_seg_size, *s_size, *s_alignment;
static PyObject *default_dims; /* (1, 1, 1): the default of global_size and local_size */
static PyObject *gates;        /* ((module dict, name), ...): the fast path runs only while each is None, False or 0 */

static int gates_closed(void) {
  if (gates == NULL) return 1;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(gates); i++) {
    PyObject *pair = PyTuple_GET_ITEM(gates, i);
    PyObject *v = PyDict_GetItemWithError(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)); /* borrowed */
    if (v == NULL) { if (PyErr_Occurred()) return -1; continue; }
    if (v == Py_None || v == Py_False) continue;
    if (PyLong_CheckExact(v) && PyObject_Not(v) == 1) continue;
    return 1;
  }
  return 0;
}

static PyObject *set_submit_slice(PyObject *module, PyObject *arg) {
  (void)module;
  long long ns = PyLong_AsLongLong(arg);
  if (ns == -1 && PyErr_Occurred()) return NULL;
  if (ns <= 0) { PyErr_SetString(PyExc_ValueError, "set_submit_slice takes a number of ns > 0"); return NULL; }
  SUBMIT_SLICE_NS = ns;
  Py_RETURN_NONE;
}

static PyObject *set_gates(PyObject *module, PyObject *arg) {
  if (!PyTuple_Check(arg)) { PyErr_SetString(PyExc_TypeError, "set_gates takes a tuple of (dict, name) pairs"); return NULL; }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(arg); i++) {
    PyObject *p = PyTuple_GET_ITEM(arg, i);
    if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2 || !PyDict_Check(PyTuple_GET_ITEM(p, 0)) || !PyUnicode_Check(PyTuple_GET_ITEM(p, 1))) {
      PyErr_SetString(PyExc_TypeError, "set_gates takes a tuple of (dict, name) pairs");
      return NULL;
    }
  }
  Py_INCREF(arg);
  Py_XSETREF(gates, arg);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------------ DeviceState */
/* What the native paths need of one device, made once (HCQCompiled.native_state): the device, a view of its state
 * words (hcq/device_state.py: the timeline value, open, the timeline's address; Python reads and writes the same
 * words through properties) and the set its submissions list it in. No attribute of the device is looked up. */
typedef struct {
  PyObject_HEAD
  PyObject *dev, *busy;  /* busy: hcq.lifetimes' busy set of the device's peer group */
  Py_buffer view;
  uint64_t *w;           /* the state words (NULL until made) */
} DeviceState;

static int devstate_traverse(DeviceState *d, visitproc visit, void *arg) {
  Py_VISIT(d->dev); Py_VISIT(d->busy);
  return 0;
}

static int devstate_clear(DeviceState *d) {
  if (d->w != NULL) { PyBuffer_Release(&d->view); d->w = NULL; }
  Py_CLEAR(d->dev); Py_CLEAR(d->busy);
  return 0;
}

static void devstate_dealloc(DeviceState *d) {
  PyObject_GC_UnTrack(d);
  devstate_clear(d);
  Py_TYPE(d)->tp_free((PyObject *)d);
}

static int devstate_init(DeviceState *d, PyObject *args, PyObject *kwargs) {
  PyObject *dev, *words, *busy;
  if (!PyArg_ParseTuple(args, "OOO!", &dev, &words, &PySet_Type, &busy)) return -1;
  if (d->w != NULL) { PyErr_SetString(PyExc_RuntimeError, "DeviceState is made once"); return -1; }
  if (PyObject_GetBuffer(words, &d->view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
  if (d->view.itemsize != 8 || d->view.len != DS_WORDS * 8 || strcmp(d->view.format, "Q") != 0 || (uintptr_t)d->view.buf % 8) {
    PyBuffer_Release(&d->view);
    PyErr_Format(PyExc_ValueError, "DeviceState: the state words must be an array('Q') of %d words", (int)DS_WORDS);
    return -1;
  }
  d->w = (uint64_t *)d->view.buf;
  Py_INCREF(dev); d->dev = dev;
  Py_INCREF(busy); d->busy = busy;
  return 0;
}

/* The timeline value a submission of the device waits after and signals, or 0 when the device takes no new work. */
static uint64_t devstate_timeline(const DeviceState *d) {
  uint64_t tv = d->w[DS_TIMELINE_VALUE];
  return d->w[DS_OPEN] && tv != 0 && tv < (1ULL << 62) ? tv : 0;
}

/* hcq.lifetimes.mark_busy in C: list the device among its peer group's busy devices, once the submission is counted
 * (the timeline stepped or ring.count stored). One set add, no Python code: no Ctrl-C can come between the two. */
static int devstate_mark_busy(DeviceState *d) { return PySet_Add(d->busy, d->dev); }

/* A submission that signals timeline value tv went in: the timeline steps and the device is busy (the rule of
 * HCQCompiled.next_timeline and mark_busy, as every runtime submission does them). */
static int devstate_submitted(DeviceState *d, uint64_t tv) {
  d->w[DS_TIMELINE_VALUE] = tv + 1;
  return devstate_mark_busy(d);
}

static PyTypeObject DeviceStateType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "hcq._hotpath.DeviceState",
  .tp_basicsize = sizeof(DeviceState),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
  .tp_doc = "DeviceState(dev, state_words, busy_set): what the native paths need of one device",
  .tp_new = PyType_GenericNew,
  .tp_init = (initproc)devstate_init,
  .tp_traverse = (traverseproc)devstate_traverse,
  .tp_clear = (inquiry)devstate_clear,
  .tp_dealloc = (destructor)devstate_dealloc,
};

/* ------------------------------------------------------------------------------------------------ Launcher */
typedef struct {
  PyObject_HEAD
  DeviceState *ds;        /* the device */
  PyObject *py;           /* the Python FastLauncher: dims_words(global_size, local_size) */
  PyObject *buffer_type;  /* hcq.HCQBuffer */
  submit_fn submit;
  void *ring;
  uint64_t kernargs_host, kernargs_dev;
  /* the kernargs TimelineRing the state below was read from, and views of its state arrays */
  PyObject *kring;
  Py_buffer kstate, ktags;
  int64_t seg_size, ring_size, alignment;
} Launcher;

static void launcher_release_ring(Launcher *l) {
  if (l->kring == NULL) return;
  PyBuffer_Release(&l->kstate);
  PyBuffer_Release(&l->ktags);
  Py_CLEAR(l->kring);
}

static int launcher_traverse(Launcher *l, visitproc visit, void *arg) {
  Py_VISIT((PyObject *)l->ds); Py_VISIT(l->py); Py_VISIT(l->buffer_type); Py_VISIT(l->kring);
  return 0;
}

static int launcher_clear(Launcher *l) {
  launcher_release_ring(l);
  Py_CLEAR(l->ds); Py_CLEAR(l->py); Py_CLEAR(l->buffer_type);
  return 0;
}

static void launcher_dealloc(Launcher *l) {
  PyObject_GC_UnTrack(l);
  launcher_clear(l);
  Py_TYPE(l)->tp_free((PyObject *)l);
}

static int launcher_read_ring(Launcher *l, PyObject *kring);

static int launcher_init(Launcher *l, PyObject *args, PyObject *kwargs) {
  static char *kw[] = {"device_state", "py", "buffer_type", "submit_address", "ring", "kernargs_host", "kernargs_dev", "kernargs_ring", NULL};
  PyObject *ds, *py, *btype, *kring;
  unsigned long long submit, ring, khost, kdev;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOKKKKO", kw, &DeviceStateType, &ds, &py, &btype, &submit, &ring, &khost, &kdev, &kring)) return -1;
  if (!PyType_Check(btype)) { PyErr_SetString(PyExc_TypeError, "Launcher: buffer_type must be a type"); return -1; }
  if (!submit || !ring || !khost) { PyErr_SetString(PyExc_ValueError, "Launcher: submit_address, ring and kernargs_host must be non-zero"); return -1; }
  launcher_clear(l);
  if (!launcher_read_ring(l, kring)) { PyErr_SetString(PyExc_ValueError, "Launcher: kernargs_ring is not a TimelineRing the launcher can view"); return -1; }
  Py_INCREF(ds); l->ds = (DeviceState *)ds;
  Py_INCREF(py); l->py = py;
  Py_INCREF(btype); l->buffer_type = btype;
  l->submit = (submit_fn)(uintptr_t)submit;
  l->ring = (void *)(uintptr_t)ring;
  l->kernargs_host = khost;
  l->kernargs_dev = kdev;
  return 0;
}

/* Views of a TimelineRing's state (array('q'): head, current segment, end of the current segment, lap) and
 * segment tags (array('q')). While viewed, the arrays cannot be resized (they refuse, exporting a buffer). */
static int launcher_read_ring(Launcher *l, PyObject *kring) {
  launcher_release_ring(l);
  PyObject *state = PyObject_GetAttr(kring, s_state), *tags = PyObject_GetAttr(kring, s_seg_tags);
  PyObject *seg = PyObject_GetAttr(kring, s_seg_size), *size = PyObject_GetAttr(kring, s_size), *align = PyObject_GetAttr(kring, s_alignment);
  int ok = state && tags && seg && size && align;
  if (ok) {
    l->seg_size = PyLong_AsLongLong(seg);
    l->ring_size = PyLong_AsLongLong(size);
    l->alignment = PyLong_AsLongLong(align);
    ok = !PyErr_Occurred() && l->seg_size > 0 && l->ring_size > 0 && l->alignment > 0;
  }
  if (ok && PyObject_GetBuffer(state, &l->kstate, PyBUF_WRITABLE | PyBUF_FORMAT) == 0) {
    if (PyObject_GetBuffer(tags, &l->ktags, PyBUF_WRITABLE | PyBUF_FORMAT) == 0) {
      int fmt_ok = l->kstate.itemsize == 8 && l->ktags.itemsize == 8 && l->kstate.len >= 4 * 8 &&
                   l->ktags.len * l->seg_size >= l->ring_size * 8 && strcmp(l->kstate.format, "q") == 0 && strcmp(l->ktags.format, "q") == 0;
      if (fmt_ok) { Py_INCREF(kring); l->kring = kring; }
      else { PyBuffer_Release(&l->ktags); PyBuffer_Release(&l->kstate); }
    } else {
      PyBuffer_Release(&l->kstate);
    }
  }
  Py_XDECREF(state); Py_XDECREF(tags); Py_XDECREF(seg); Py_XDECREF(size); Py_XDECREF(align);
  PyErr_Clear();
  return l->kring != NULL;
}

static PyTypeObject LauncherType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "hcq._hotpath.Launcher",
  .tp_basicsize = sizeof(Launcher),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
  .tp_doc = "Launcher(device_state, py, buffer_type, submit_address, ring, kernargs_host, kernargs_dev, kernargs_ring): the launch hot path of one device",
  .tp_new = PyType_GenericNew,
  .tp_init = (initproc)launcher_init,
  .tp_traverse = (traverseproc)launcher_traverse,
  .tp_clear = (inquiry)launcher_clear,
  .tp_dealloc = (destructor)launcher_dealloc,
};

/* ------------------------------------------------------------------------------------------------ Launchable */
typedef struct {
  PyObject_HEAD
  int plan_state;             /* 0: the plan not read yet; 1: read; -1: this program always takes the checked path */
  Launcher *launcher;
  PyObject *dims_g, *dims_l;  /* the dims the words hold (exact tuples or ints) */
  uint64_t words[MAX_WORDS];  /* the plan's words, then the dims of the last launch */
  int nwords, kernargs_word, dims_word, wait_word, signal_word, tl_words[2];  /* the words each launch patches */
  uint64_t kernargs_size;
  int nptrs, nscalars, values_permuted;
  uint32_t ptr_offsets[MAX_PARAMS];
  PyObject *pack_values;      /* the layout's values_packer's pack (NULL without values): the one definition of packing */
  uint8_t values_order[MAX_PARAMS];  /* the packer's argument i is value values_order[i] (when values_permuted) */
  uint64_t real_values;       /* bit i: value i may be a float (KernargsLayout.real_values) */
} Launchable;

static int launchable_traverse(Launchable *p, visitproc visit, void *arg) {
  Py_VISIT(p->launcher); Py_VISIT(p->dims_g); Py_VISIT(p->dims_l); Py_VISIT(p->pack_values);
  return 0;
}

static int launchable_clear(Launchable *p) {
  Py_CLEAR(p->launcher); Py_CLEAR(p->dims_g); Py_CLEAR(p->dims_l); Py_CLEAR(p->pack_values);
  p->plan_state = 0;
  return 0;
}

static void launchable_dealloc(Launchable *p) {
  PyObject_GC_UnTrack(p);
  launchable_clear(p);
  Py_TYPE(p)->tp_free((PyObject *)p);
}

/* An int attribute of a launch plan in [0, limit): its value, or -1 with an exception set naming the field. */
static long long plan_int(PyObject *plan, const char *name, long long limit) {
  PyObject *v = PyObject_GetAttrString(plan, name);
  long long x = v != NULL && PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
  Py_XDECREF(v);
  if (x == -1 && PyErr_Occurred()) return -1;
  if (x < 0 || x >= limit) {
    PyErr_Format(PyExc_ValueError, "launch plan: %s is not an int in [0, %lld)", name, limit);
    return -1;
  }
  return x;
}

/* A tuple attribute of a launch plan (a new reference), or NULL with an exception set. */
static PyObject *plan_tuple(PyObject *plan, const char *name) {
  PyObject *v = PyObject_GetAttrString(plan, name);
  if (v != NULL && !PyTuple_Check(v)) {
    Py_DECREF(v);
    PyErr_Format(PyExc_TypeError, "launch plan: %s is not a tuple", name);
    return NULL;
  }
  return v;
}

/* Read prg._native_plan(): None (always the checked path) or (launcher, hcq.packet_queue.LaunchPlan). The plan says
 * which words each launch patches and where the arguments go (the values packed by the layout's struct); what does not
 * fit this launcher's fixed arrays leaves every launch of the program to the checked path. A malformed plan raises. */
static int launchable_load(Launchable *p) {
  PyObject *t = PyObject_CallMethodNoArgs((PyObject *)p, s_native_plan);
  if (t == NULL) return -1;
  p->plan_state = -1;
  if (t == Py_None) { Py_DECREF(t); return 0; }
  PyObject *l, *plan, *words = NULL, *layout = NULL, *ptrs = NULL, *scalars = NULL, *tl = NULL, *packer = NULL, *pack = NULL;
  int rc = -1;
  long long at[6], ksize;
  if (!PyArg_ParseTuple(t, "O!O", &LauncherType, &l, &plan)) goto done;
  words = plan_tuple(plan, "words");
  tl = words ? plan_tuple(plan, "timeline_at") : NULL;
  layout = tl ? PyObject_GetAttrString(plan, "layout") : NULL;
  ptrs = layout ? plan_tuple(layout, "pointers") : NULL;
  scalars = ptrs ? plan_tuple(layout, "scalars") : NULL;
  if (scalars == NULL || (ksize = plan_int(layout, "size", 1LL << 40)) < 0) goto done;
  Py_ssize_t nw = PyTuple_GET_SIZE(words), np = PyTuple_GET_SIZE(ptrs), ns = PyTuple_GET_SIZE(scalars);
  rc = 0;  /* more than this launcher holds (parameters, kernargs bytes, words): every launch takes the checked path */
  if (nw > MAX_WORDS || nw < 6 || np > MAX_PARAMS || ns > MAX_PARAMS || ksize > MAX_KERNARGS || ksize == 0) goto done;
  rc = -1;
  if ((at[0] = plan_int(plan, "wait_at", nw)) < 0 || (at[1] = plan_int(plan, "signal_at", nw)) < 0 ||
      (at[2] = plan_int(plan, "kernargs_at", nw)) < 0 || (at[3] = plan_int(plan, "dims_at", nw - 5)) < 0) goto done;
  if (PyTuple_GET_SIZE(tl) != 2) { PyErr_SetString(PyExc_ValueError, "launch plan: timeline_at names two words"); goto done; }
  for (int i = 0; i < 2; i++) {
    at[4 + i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tl, i));
    if (at[4 + i] < 0 || at[4 + i] >= nw) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "launch plan: timeline_at lies outside the words");
      goto done;
    }
  }
  for (Py_ssize_t i = 0; i < nw; i++) p->words[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(words, i));
  for (Py_ssize_t i = 0; i < np; i++) p->ptr_offsets[i] = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(ptrs, i));
  if (PyErr_Occurred()) goto done;
  for (Py_ssize_t i = 0; i < np; i++) if ((uint64_t)p->ptr_offsets[i] + 8 > (uint64_t)ksize) goto range;
  p->values_permuted = 0;
  p->real_values = 0;
  if (ns) {
    PyObject *real = PyObject_GetAttrString(layout, "real_values");
    int ok = real != NULL && PyTuple_Check(real) && PyTuple_GET_SIZE(real) == ns;
    for (Py_ssize_t i = 0; ok && i < ns; i++) if (PyTuple_GET_ITEM(real, i) == Py_True) p->real_values |= 1ull << i;
    Py_XDECREF(real);
    if (!ok) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "launch plan: real_values is not one bool per value"); goto done; }  /* the values: packed by the layout's own struct (values_packer: (struct, order or None)) */
    PyObject *st, *order;
    packer = PyObject_GetAttrString(layout, "values_packer");
    if (packer == NULL || !PyArg_ParseTuple(packer, "OO", &st, &order)) goto done;
    PyObject *size = PyObject_GetAttrString(st, "size");
    long long packed = size != NULL && PyLong_Check(size) ? PyLong_AsLongLong(size) : -1;
    Py_XDECREF(size);
    if (packed < 0 || (pack = PyObject_GetAttrString(st, "pack")) == NULL) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "launch plan: values_packer is not a struct"); goto done; }
    if (packed > ksize) goto range;
    if (order != Py_None) {
      if (!PyTuple_Check(order) || PyTuple_GET_SIZE(order) != ns) { PyErr_SetString(PyExc_ValueError, "launch plan: values_packer's order is not one index per value"); goto done; }
      for (Py_ssize_t i = 0; i < ns; i++) {
        long long k = PyLong_AsLongLong(PyTuple_GET_ITEM(order, i));
        if (k < 0 || k >= ns) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "launch plan: values_packer's order names no value"); goto done; }
        p->values_order[i] = (uint8_t)k;
      }
      p->values_permuted = 1;
    }
  }
  p->nwords = (int)nw; p->wait_word = (int)at[0]; p->signal_word = (int)at[1]; p->kernargs_word = (int)at[2]; p->dims_word = (int)at[3];
  p->tl_words[0] = (int)at[4]; p->tl_words[1] = (int)at[5];
  p->kernargs_size = (uint64_t)ksize;
  p->nptrs = (int)np; p->nscalars = (int)ns;
  Py_XSETREF(p->pack_values, pack); pack = NULL;
  Py_INCREF(l);
  Py_XSETREF(p->launcher, (Launcher *)l);
  Py_CLEAR(p->dims_g); Py_CLEAR(p->dims_l);  /* the words' dims are unknown until the first launch fills them */
  p->plan_state = 1;
  rc = 0;
  goto done;
range:
  PyErr_SetString(PyExc_ValueError, "launch plan: a parameter lies outside the kernargs block");
done:
  Py_DECREF(t); Py_XDECREF(words); Py_XDECREF(tl); Py_XDECREF(layout); Py_XDECREF(ptrs); Py_XDECREF(scalars);
  Py_XDECREF(packer); Py_XDECREF(pack);
  return rc;
}

static int same_dims(PyObject *given, PyObject *cached) {
  if (given == cached) return 1;
  if (cached == NULL || Py_TYPE(given) != Py_TYPE(cached)) return 0;
  return PyObject_RichCompareBool(given, cached, Py_EQ) == 1;  /* exact tuples or ints: equality is by value */
}

/* Dims the native path compares as they are: an int or a tuple of ints (exactly: True == 1, so a bool would pass as
 * the cached 1; numpy's integers take the checked path, which converts them). */
static int exact_dims(PyObject *d) {
  if (PyLong_CheckExact(d)) return 1;
  if (!PyTuple_CheckExact(d)) return 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(d); i++) if (!PyLong_CheckExact(PyTuple_GET_ITEM(d, i))) return 0;
  return 1;
}

/* Fill the words' dims from the Python FastLauncher (which checks them); 0 when it declines. */
static int launchable_set_dims(Launchable *p, PyObject *gs, PyObject *ls) {
  PyObject *six = PyObject_CallMethodObjArgs(p->launcher->py, s_dims_words, gs, ls, NULL);
  if (six == NULL) return -1;
  int ok = PyTuple_Check(six) && PyTuple_GET_SIZE(six) == 6;
  uint64_t d[6];
  for (int i = 0; ok && i < 6; i++) {
    d[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(six, i));
    if (PyErr_Occurred()) { PyErr_Clear(); ok = 0; }
  }
  Py_DECREF(six);
  if (!ok) return 0;
  memcpy(&p->words[p->dims_word], d, sizeof d);
  Py_INCREF(gs); Py_XSETREF(p->dims_g, gs);
  Py_INCREF(ls); Py_XSETREF(p->dims_l, ls);
  return 1;
}

/* An attribute that must be an int in [0, 2^64): its value, or 0 with *ok cleared. */
static uint64_t u64_attr(PyObject *o, PyObject *name, int *ok) {
  PyObject *v = PyObject_GetAttr(o, name);
  uint64_t r = 0;
  if (v != NULL && PyLong_CheckExact(v)) {
    r = PyLong_AsUnsignedLongLong(v);
    if (PyErr_Occurred()) *ok = 0;
  } else {
    *ok = 0;
  }
  Py_XDECREF(v);
  return r;
}

/* The values packed at their offsets by the layout's struct (KernargsLayout.values_packer, the Python run's packing too):
 * 1, 0 when a value is not an exact int, or an exact float for a floating parameter (KernargsLayout.accepts: the
 * checked path converts or refuses the rest) or does not fit its parameter (struct refuses it: the checked path says why), -1 on an error to raise. The
 * packer is C code: for exact ints and floats no Python code runs, so no Ctrl-C lands between here and the submit. */
static int pack_values(Launchable *p, PyObject *vals, unsigned char *staged) {
  PyObject *args[MAX_PARAMS];
  for (int i = 0; i < p->nscalars; i++) {
    int k = p->values_permuted ? p->values_order[i] : i;
    PyObject *v = PyTuple_GET_ITEM(vals, k);
    if (!PyLong_CheckExact(v) && !(PyFloat_CheckExact(v) && (p->real_values >> k & 1))) return 0;
    args[i] = v;
  }
  PyObject *packed = PyObject_Vectorcall(p->pack_values, args, (size_t)p->nscalars, NULL);
  if (packed == NULL) {
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) return -1;
    PyErr_Clear();
    return 0;
  }
  int ok = PyBytes_CheckExact(packed) && (uint64_t)PyBytes_GET_SIZE(packed) <= p->kernargs_size;
  if (ok) memcpy(staged, PyBytes_AS_STRING(packed), (size_t)PyBytes_GET_SIZE(packed));
  Py_DECREF(packed);
  return ok;
}

/* The fast launch: 1 done, 0 declined (nothing submitted; the caller takes the checked path), -1 error. */
static int fast_launch(Launchable *p, PyObject *bufs, PyObject *kwargs) {
  PyObject *gs = default_dims, *ls = default_dims, *vals = NULL;
  if (kwargs != NULL) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &k, &v)) {
      if (k == s_global_size) gs = v;
      else if (k == s_local_size) ls = v;
      else if (k == s_vals) vals = v;
      else if (k == s_wait) { if (v != Py_False) return 0; }
      else if (k == s_timeout) { if (v != Py_None) return 0; }
      else return 0;  /* not interned, or not a parameter: the checked path sorts it out */
    }
  }
  if (p->plan_state < 0) return 0;
  int g = gates_closed();
  if (g) return g < 0 ? -1 : 0;
  if (p->plan_state == 0 && launchable_load(p) < 0) return -1;
  if (p->plan_state < 0) return 0;
  Launcher *l = p->launcher;
  Py_ssize_t nbufs = PyTuple_GET_SIZE(bufs), nvals = vals == NULL ? 0 : (PyTuple_CheckExact(vals) ? PyTuple_GET_SIZE(vals) : -1);
  if (nbufs != p->nptrs || nvals != p->nscalars) return 0;
  if (!exact_dims(gs) || !exact_dims(ls)) return 0;

  /* the device: open, its timeline */
  DeviceState *ds = l->ds;
  PyObject *dev = ds->dev;
  uint64_t tv = devstate_timeline(ds), tl_addr = ds->w[DS_TIMELINE_ADDRESS];
  if (tv == 0 || tl_addr == 0) return 0;
  int ok = 1;

  if (!same_dims(gs, p->dims_g) || !same_dims(ls, p->dims_l)) {
    int r = launchable_set_dims(p, gs, ls);
    if (r <= 0) return r;
  }

  /* the arguments, checked before anything is written */
  uint64_t ptrs[MAX_PARAMS];
  for (Py_ssize_t i = 0; i < nbufs; i++) {
    PyObject *b = PyTuple_GET_ITEM(bufs, i);
    if (!PyObject_TypeCheck(b, (PyTypeObject *)l->buffer_type)) return 0;
    PyObject *root = PyObject_GetAttr(b, s_root);
    PyObject *freed = root ? PyObject_GetAttr(root, s_freed) : NULL, *owner = root ? PyObject_GetAttr(root, s_owner) : NULL;
    PyObject *ro = root ? PyObject_GetAttr(root, s_readonly) : NULL;
    /* another device's buffer: the checked path maps a peer's or refuses; read-only memory: it checks the parameter */
    ok = freed == Py_False && owner == dev && ro == Py_False;
    Py_XDECREF(root); Py_XDECREF(freed); Py_XDECREF(owner); Py_XDECREF(ro);
    if (ok) ptrs[i] = u64_attr(b, s_va_addr, &ok);  /* a symbolic address is not an int: declined */
    if (!ok) { PyErr_Clear(); return 0; }
  }

  unsigned char staged[MAX_KERNARGS];  /* offsets were checked against kernargs_size <= MAX_KERNARGS at load */
  memset(staged, 0, p->kernargs_size);
  if (p->nscalars && (ok = pack_values(p, vals, staged)) <= 0) return ok;
  for (int i = 0; i < p->nptrs; i++) memcpy(staged + p->ptr_offsets[i], &ptrs[i], 8);

  /* kernargs: a block of the kernargs ring, taken by hcq/timeline_ring.h's take. One it asks to wait for earlier work
   * first (or refuses) is TimelineRing.alloc's, which waits (or raises) and takes it the same way. */
  int64_t need, start = hcq_timeline_ring_take((int64_t *)l->kstate.buf, (int64_t *)l->ktags.buf, l->ktags.len / 8, l->ring_size,
                                               l->seg_size, (int64_t)p->kernargs_size, (int64_t)tv, l->alignment, 0, &need);
  if (start < 0) {
    PyObject *off = PyObject_CallMethod(l->kring, "alloc", "KKL", (unsigned long long)p->kernargs_size, (unsigned long long)tv, (long long)l->alignment);
    if (off == NULL) return -1;  /* a wait that timed out or was interrupted: nothing was submitted */
    start = PyLong_AsLongLong(off);
    Py_DECREF(off);
    if (start < 0 || start + (int64_t)p->kernargs_size > l->ring_size) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "kernargs ring handed out a block outside itself");
      return -1;
    }
  }
  memcpy((void *)(uintptr_t)(l->kernargs_host + (uint64_t)start), staged, p->kernargs_size);

  /* the plan's words, patched where it says: the timeline's address, the value waited for and the one signalled */
  uint64_t w[MAX_WORDS];
  int n = p->nwords;
  memcpy(w, p->words, (size_t)n * 8);
  w[p->tl_words[0]] = w[p->tl_words[1]] = tl_addr;
  w[p->wait_word] = tv - 1;
  w[p->kernargs_word] = l->kernargs_dev + (uint64_t)start;
  w[p->signal_word] = tv;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = l->submit(l->ring, w, (uint64_t)n, SUBMIT_SLICE_NS);
  Py_END_ALLOW_THREADS
  if (rc != SUBMIT_OK) return 0;  /* nothing was queued: the checked path waits for room or reports the failure */
  return devstate_submitted(ds, tv) < 0 ? -1 : 1;
}

static PyObject *launchable_call(Launchable *p, PyObject *args, PyObject *kwargs) {
  int r = fast_launch(p, args, kwargs);
  if (r > 0) Py_RETURN_NONE;
  if (r < 0) return NULL;
  PyObject *launch = PyObject_GetAttr((PyObject *)p, s_launch);
  if (launch == NULL) return NULL;
  PyObject *res = PyObject_Call(launch, args, kwargs);
  Py_DECREF(launch);
  return res;
}

static PyTypeObject LaunchableType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "hcq._hotpath.Launchable",
  .tp_basicsize = sizeof(Launchable),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
  .tp_doc = "Base of hcq.HCQProgram: prg(...) launches through the native fast path, else calls prg.launch(...)",
  .tp_new = PyType_GenericNew,
  .tp_call = (ternaryfunc)launchable_call,
  .tp_traverse = (traverseproc)launchable_traverse,
  .tp_clear = (inquiry)launchable_clear,
  .tp_dealloc = (destructor)launchable_dealloc,
};

/* ------------------------------------------------------------------------------------------------ RingLock */
/* The lock of a submission ring (hcq.lifetimes.Ring.lock): threading.Lock's interface (acquire(blocking=True),
 * release(), with), over a pthread mutex that the native re-submit takes without a Python call. A blocking acquire
 * waits with the GIL released, in slices, so a Ctrl-C to the waiting main thread is still raised. Only the thread
 * that acquired it releases it (as every use in hcq does). */
typedef struct {
  PyObject_HEAD
  pthread_mutex_t m;
  int held;  /* (for locked() and a clear error on a release that was not acquired; changed under the mutex) */
} RingLock;

static PyObject *ringlock_new(PyTypeObject *t, PyObject *args, PyObject *kwargs) {
  RingLock *l = (RingLock *)t->tp_alloc(t, 0);
  if (l != NULL) pthread_mutex_init(&l->m, NULL);
  return (PyObject *)l;
}

static void ringlock_dealloc(RingLock *l) {
  pthread_mutex_destroy(&l->m);
  Py_TYPE(l)->tp_free((PyObject *)l);
}

static int ringlock_take(RingLock *l, int blocking) {  /* 1 taken, 0 not (non-blocking), -1 interrupted */
  if (pthread_mutex_trylock(&l->m) == 0) { l->held = 1; return 1; }
  if (!blocking) return 0;
  for (;;) {
    int rc;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 20000000;
    if (until.tv_nsec >= 1000000000) { until.tv_sec += 1; until.tv_nsec -= 1000000000; }
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_mutex_timedlock(&l->m, &until);
    Py_END_ALLOW_THREADS
    if (rc == 0) { l->held = 1; return 1; }
    if (PyErr_CheckSignals() < 0) return -1;
  }
}

static PyObject *ringlock_acquire(RingLock *l, PyObject *args, PyObject *kwargs) {
  static char *kw[] = {"blocking", "timeout", NULL};
  int blocking = 1;
  double timeout = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|pd", kw, &blocking, &timeout)) return NULL;
  if (timeout != -1) { PyErr_SetString(PyExc_ValueError, "a ring lock takes no timeout"); return NULL; }
  int r = ringlock_take(l, blocking);
  if (r < 0) return NULL;
  return PyBool_FromLong(r);
}

static void ringlock_give(RingLock *l) {
  l->held = 0;
  pthread_mutex_unlock(&l->m);
}

static PyObject *ringlock_release(RingLock *l, PyObject *unused) {
  if (!l->held) { PyErr_SetString(PyExc_RuntimeError, "release unlocked lock"); return NULL; }
  ringlock_give(l);
  Py_RETURN_NONE;
}

static PyObject *ringlock_enter(RingLock *l, PyObject *unused) {
  if (ringlock_take(l, 1) < 0) return NULL;
  Py_RETURN_TRUE;
}

static PyObject *ringlock_exit(RingLock *l, PyObject *args) { return ringlock_release(l, NULL); }
static PyObject *ringlock_locked(RingLock *l, PyObject *unused) { return PyBool_FromLong(l->held); }

static PyMethodDef ringlock_methods[] = {
  {"acquire", (PyCFunction)(void (*)(void))ringlock_acquire, METH_VARARGS | METH_KEYWORDS, "acquire(blocking=True) -> bool"},
  {"release", (PyCFunction)ringlock_release, METH_NOARGS, "release()"},
  {"locked", (PyCFunction)ringlock_locked, METH_NOARGS, "locked() -> bool"},
  {"__enter__", (PyCFunction)ringlock_enter, METH_NOARGS, NULL},
  {"__exit__", (PyCFunction)ringlock_exit, METH_VARARGS, NULL},
  {NULL, NULL, 0, NULL},
};

static PyTypeObject RingLockType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "hcq._hotpath.RingLock",
  .tp_basicsize = sizeof(RingLock),
  .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_doc = "RingLock(): a submission ring's lock (threading.Lock's interface) the native re-submit takes directly",
  .tp_new = ringlock_new,
  .tp_dealloc = (destructor)ringlock_dealloc,
  .tp_methods = ringlock_methods,
};

/* ------------------------------------------------------------------------------------------------ fence words */
/* A view of a one-word array('Q'): a ring's count (lifetimes.Ring.state) or a queue's last fence (HWQueue._fence_word),
 * which the native runs advance in place under the ring's lock, as Ring.note does. While viewed, it cannot be resized. */
static uint64_t *fence_word_view(PyObject *array, Py_buffer *view, const char *what) {
  if (PyObject_GetBuffer(array, view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
  if (view->itemsize != 8 || view->len != 8 || strcmp(view->format, "Q") != 0) {
    PyBuffer_Release(view);
    PyErr_Format(PyExc_ValueError, "%s must be an array('Q') of one word", what);
    return NULL;
  }
  return (uint64_t *)view->buf;
}

static void fence_word_release(Py_buffer *view) {
  if (view->obj != NULL) PyBuffer_Release(view);
}

/* ------------------------------------------------------------------------------------------------ Resubmit */
/* A built queue re-submitted to the same device: its words (encoded once, with the ring's fence packet at the end)
 * have their symbols (plain Variables only) resolved from var_vals and go to the ring in one native call, numbered
 * from the ring's count word under the ring's lock, which it then advances with the queue's last fence word (as
 * Ring.note does). What the submissions reference (the queue's keepalive) it holds itself, and the ring holds it once
 * the Resubmit goes (Ring.held_by). Made by
 * PacketQueue._native_resubmit for unbound queues the checked path has submitted once; anything unusual (a symbol
 * missing or out of range, the queue grown since, the ring's lock taken, a full ring) returns False with nothing
 * submitted, and HWQueue.submit takes the checked path. */
typedef struct { Py_ssize_t word; PyObject *name; long long vmin, vmax; } Sym;

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;  /* calls skip the argument tuple */
  RingLock *ringlock;         /* the ring's lock (taken without a Python call) */
  DeviceState *ds;
  PyObject *keepalive, *words_list;  /* words_list: q._q */
  PyObject *weakrefs;
  Py_buffer count_view, fence_view, last_view;
  uint64_t *count, *fence, *last;  /* the ring's count, the queue's last fence, this run's last submission (fence words) */
  Py_ssize_t list_len;
  submit_fn submit;
  void *ring_handle;
  uint64_t *words;
  Py_ssize_t nwords;  /* the queue's words, then [SIGNAL fence value] */
  Sym *syms;
  Py_ssize_t nsyms;
} Resubmit;

static PyObject *s_q;
static PyObject *resubmit_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static int resubmit_traverse(Resubmit *r, visitproc visit, void *arg) {
  Py_VISIT((PyObject *)r->ds); Py_VISIT(r->keepalive); Py_VISIT(r->words_list); Py_VISIT((PyObject *)r->ringlock);
  for (Py_ssize_t i = 0; i < r->nsyms; i++) Py_VISIT(r->syms[i].name);
  return 0;
}

static int resubmit_clear(Resubmit *r) {
  Py_CLEAR(r->ds); Py_CLEAR(r->keepalive); Py_CLEAR(r->words_list); Py_CLEAR(r->ringlock);
  for (Py_ssize_t i = 0; i < r->nsyms; i++) Py_CLEAR(r->syms[i].name);
  return 0;
}

static void resubmit_dealloc(Resubmit *r) {
  PyObject_GC_UnTrack(r);
  if (r->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)r);  /* (Ring.held_by's finalizer: the ring takes the keepalive) */
  resubmit_clear(r);
  fence_word_release(&r->count_view);
  fence_word_release(&r->fence_view);
  fence_word_release(&r->last_view);
  PyMem_Free(r->words);
  PyMem_Free(r->syms);
  Py_TYPE(r)->tp_free((PyObject *)r);
}

/* Resubmit(device_state, ring, submit_address, words, ((word index, name, vmin, vmax), ...), keepalive, words_list,
 *          the ring's count word, the queue's last fence word, this run's own last-submission word) */
static int resubmit_init(Resubmit *r, PyObject *args, PyObject *kwargs) {
  PyObject *ds, *ring, *words, *syms, *keep, *wlist, *count, *fence, *last;
  unsigned long long address;
  if (!PyArg_ParseTuple(args, "O!OKO!O!O!O!OOO", &DeviceStateType, &ds, &ring, &address, &PyTuple_Type, &words, &PyTuple_Type, &syms, &PyList_Type, &keep,
                        &PyList_Type, &wlist, &count, &fence, &last)) return -1;
  if (r->words != NULL) { PyErr_SetString(PyExc_RuntimeError, "Resubmit is made once"); return -1; }
  Py_ssize_t n = PyTuple_GET_SIZE(words), ns = PyTuple_GET_SIZE(syms);
  if (!address || n < 3) { PyErr_SetString(PyExc_ValueError, "Resubmit: a submit function and at least the fence packet are needed"); return -1; }
  r->words = PyMem_Calloc((size_t)n, 8);
  r->syms = PyMem_Calloc((size_t)(ns ? ns : 1), sizeof(Sym));
  if (!r->words || !r->syms) { PyErr_NoMemory(); return -1; }
  for (Py_ssize_t i = 0; i < n; i++) r->words[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(words, i));
  if (PyErr_Occurred()) return -1;
  for (Py_ssize_t i = 0; i < ns; i++) {
    Sym *y = &r->syms[i];
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(syms, i), "nULL", &y->word, &y->name, &y->vmin, &y->vmax)) return -1;
    if (y->word < 0 || y->word >= n - 3 || y->vmin < 0) { PyErr_SetString(PyExc_ValueError, "Resubmit: a symbol outside the words"); return -1; }
    Py_INCREF(y->name);
    r->nsyms = i + 1;
  }
  PyObject *handle = PyObject_GetAttrString(ring, "handle"), *lock = PyObject_GetAttrString(ring, "lock");
  r->ring_handle = handle ? PyLong_AsVoidPtr(handle) : NULL;
  Py_XDECREF(handle);
  if (lock == NULL || !Py_IS_TYPE(lock, &RingLockType) || r->ring_handle == NULL) {
    Py_XDECREF(lock);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Resubmit: a ring with a handle and a RingLock is needed");
    return -1;
  }
  r->ringlock = (RingLock *)lock;
  Py_INCREF(ds); r->ds = (DeviceState *)ds;
  Py_INCREF(keep); r->keepalive = keep;
  Py_INCREF(wlist); r->words_list = wlist;
  r->list_len = PyList_GET_SIZE(wlist);
  r->submit = (submit_fn)(uintptr_t)address;
  r->nwords = n;
  if ((r->count = fence_word_view(count, &r->count_view, "Resubmit: the ring's count")) == NULL ||
      (r->fence = fence_word_view(fence, &r->fence_view, "Resubmit: the queue's last fence")) == NULL ||
      (r->last = fence_word_view(last, &r->last_view, "Resubmit: its last submission")) == NULL) return -1;
  r->vectorcall = resubmit_vectorcall;  /* (only now: a Resubmit whose init failed cannot be called) */
  return 0;
}

/* resubmit(queue, dev, var_vals) -> True (submitted) / False (nothing submitted: take the checked path) */
static PyObject *resubmit_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  Resubmit *r = (Resubmit *)self;
  if (PyVectorcall_NARGS(nargsf) != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
    PyErr_SetString(PyExc_TypeError, "resubmit(queue, dev, var_vals) takes 3 positional arguments");
    return NULL;
  }
  PyObject *q = args[0], *dev = args[1], *vv = args[2];
  if (dev != r->ds->dev || (vv != Py_None && !PyDict_CheckExact(vv)) || (vv == Py_None && r->nsyms)) Py_RETURN_FALSE;
  int g = gates_closed();
  if (g) { if (g < 0) return NULL; Py_RETURN_FALSE; }
  PyObject *qlist = PyObject_GetAttr(q, s_q);
  int ok = qlist == r->words_list && PyList_GET_SIZE(qlist) == r->list_len && r->ds->w[DS_OPEN];
  Py_XDECREF(qlist);
  if (!ok) { PyErr_Clear(); Py_RETURN_FALSE; }
  uint64_t vals[64], *v = r->nsyms <= 64 ? vals : PyMem_Malloc((size_t)r->nsyms * 8);
  if (v == NULL) return PyErr_NoMemory();
  for (Py_ssize_t i = 0; ok && i < r->nsyms; i++) {  /* every value first: a missing or bad one submits nothing */
    Sym *y = &r->syms[i];
    PyObject *x = PyDict_GetItemWithError(vv, y->name);
    int overflow = 0;
    long long val = x != NULL && PyLong_CheckExact(x) ? PyLong_AsLongLongAndOverflow(x, &overflow) : -1;
    if (x == NULL || !PyLong_CheckExact(x) || overflow || val < y->vmin || val > y->vmax) ok = 0;
    else v[i] = (uint64_t)val;
  }
  if (!ok) { if (v != vals) PyMem_Free(v); PyErr_Clear(); Py_RETURN_FALSE; }
  /* the ring's lock, without blocking: a submission of another thread holds it, and the checked path waits for it */
  if (ringlock_take(r->ringlock, 0) != 1) { if (v != vals) PyMem_Free(v); Py_RETURN_FALSE; }
  /* under the lock: the number, the words (patched in place: no other submission of this queue runs meanwhile) */
  uint64_t value = *r->count + 1;
  for (Py_ssize_t i = 0; i < r->nsyms; i++) r->words[r->syms[i].word] = v[i];
  r->words[r->nwords - 1] = value;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = r->submit(r->ring_handle, r->words, (uint64_t)r->nwords, SUBMIT_SLICE_NS);
  Py_END_ALLOW_THREADS
  if (v != vals) PyMem_Free(v);
  if (rc == SUBMIT_OK) *r->count = *r->fence = *r->last = value;  /* (then the device is listed busy: hcq.lifetimes' rule) */
  int bad = rc < 0 || (rc == SUBMIT_OK && devstate_mark_busy(r->ds) < 0);
  ringlock_give(r->ringlock);
  if (bad) return NULL;  /* (out of memory listing the device busy, after the submission) */
  if (rc != SUBMIT_OK) Py_RETURN_FALSE;  /* nothing was queued: the checked path waits for room or reports why */
  Py_RETURN_TRUE;
}

static PyTypeObject ResubmitType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "hcq._hotpath.Resubmit",
  .tp_basicsize = sizeof(Resubmit),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
  .tp_doc = "Resubmit(device_state, ring, submit_address, words, symbols, keepalive, words_list, ring_count, queue_fence): a built queue's native re-submit",
  .tp_weaklistoffset = offsetof(Resubmit, weakrefs),
  .tp_new = PyType_GenericNew,
  .tp_init = (initproc)resubmit_init,
  .tp_call = PyVectorcall_Call,
  .tp_vectorcall_offset = offsetof(Resubmit, vectorcall),
  .tp_traverse = (traverseproc)resubmit_traverse,
  .tp_clear = (inquiry)resubmit_clear,
  .tp_dealloc = (destructor)resubmit_dealloc,
};

/* ------------------------------------------------------------------------------------------------ GraphRun */
/* A run of a one-queue HCQGraph that changes nothing but what every run changes (hcq.graph.HCQGraph._native_run):
 * with the ring's lock (taken without blocking), the kickoff and timeline words are written into the bound queue's
 * words, the queue signals reset and the kickoff opened (host stores, as signal.store(v, wake=False) does them: a
 * poison tag in the timestamp word goes first), the [INDIRECT][SIGNAL fence] words submitted, and the bookkeeping
 * of HCQGraph._submit_run, HWQueue._submit_to_ring and the patch (_prev_q, _last_var_vals, the run's values) done.
 * False, with nothing submitted, when the lock is taken or the ring full: the graph's Python path runs instead. */
enum { SLOT_KICKOFF, SLOT_WAIT, SLOT_SIGNAL };
typedef struct { uint64_t *word; int which; } Slot;  /* a queue word each run writes: 0 the kickoff, 1 the timeline wait, 2 its signal */

typedef struct {
  PyObject_HEAD
  DeviceState *ds;
  PyObject *tl_signal, *keepalive, *weakrefs;
  Py_buffer count_view, fence_view, last_view;
  uint64_t *count, *fence, *last;  /* the ring's count, the queue's last fence, this run's last submission (fence words) */
  Py_buffer marks;            /* the graph's run state words (hcq.graph_state, 'Q'): GS_KICKOFF, the last run's timeline mark */
  uint64_t tl_addr;           /* the timeline signal's device address (DS_TIMELINE_ADDRESS while it is the device's) */
  /* the graph's RunPlan (hcq.graph.RunPlan, given through use()): its inputs and variables, and lifetimes.FREES with
   * the count at which the inputs were last seen live */
  PyObject *inputs, *user_vals, *frees_list;
  uint64_t frees;
  RingLock *lock, *run_lock;  /* the ring's, the graph's */
  uint64_t *tl_word;          /* the timeline signal's value, as the host reads it */
  uint64_t last_wanted;       /* (the value the last run signals, read under the run lock) */
  submit_fn submit;
  void *ring_handle;
  uint64_t words[6];
  _Atomic uint64_t *sig_words[64], *sig_ts[64], *kick_word, *kick_ts;
  int nsigs, nslots;
  Slot slots[64];
} GraphRun;


static int graphrun_traverse(GraphRun *g, visitproc visit, void *arg) {
  Py_VISIT((PyObject *)g->ds); Py_VISIT(g->tl_signal); Py_VISIT(g->keepalive); Py_VISIT((PyObject *)g->lock);
  Py_VISIT((PyObject *)g->run_lock); Py_VISIT(g->inputs); Py_VISIT(g->user_vals); Py_VISIT(g->frees_list);
  return 0;
}

static int graphrun_clear(GraphRun *g) {
  Py_CLEAR(g->ds); Py_CLEAR(g->tl_signal); Py_CLEAR(g->keepalive); Py_CLEAR(g->lock);
  Py_CLEAR(g->run_lock); Py_CLEAR(g->inputs); Py_CLEAR(g->user_vals); Py_CLEAR(g->frees_list);
  if (g->marks.obj != NULL) PyBuffer_Release(&g->marks);
  g->nslots = 0;
  return 0;
}

static void graphrun_dealloc(GraphRun *g) {
  PyObject_GC_UnTrack(g);
  if (g->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)g);  /* (Ring.held_by's finalizer: the ring takes the keepalive) */
  graphrun_clear(g);
  fence_word_release(&g->count_view);
  fence_word_release(&g->fence_view);
  fence_word_release(&g->last_view);
  Py_TYPE(g)->tp_free((PyObject *)g);
}

/* GraphRun(device_state, ring, submit_address, words[6], ((word address, which), ...),
 *          (queue signal value/timestamp address pairs), (kickoff value, timestamp address),
 *          the graph's run state words (hcq.graph_state), the graph's run lock, the timeline value's host address,
 *          the queue's keepalive, the ring's count word, the queue's last fence word, this run's own last-submission word) */
static int graphrun_init(GraphRun *g, PyObject *args, PyObject *kwargs) {
  PyObject *ds, *ring, *words, *slots, *sigs, *marks, *run_lock, *keep, *count, *fence, *last;
  unsigned long long address, kick, kick_ts, tl_word;
  if (!PyArg_ParseTuple(args, "O!OKO!O!O!(KK)OO!KO!OOO", &DeviceStateType, &ds, &ring, &address, &PyTuple_Type, &words, &PyTuple_Type, &slots,
                        &PyTuple_Type, &sigs, &kick, &kick_ts, &marks, &RingLockType, &run_lock, &tl_word, &PyList_Type, &keep, &count, &fence, &last)) return -1;
  if (!tl_word) { PyErr_SetString(PyExc_ValueError, "GraphRun: the timeline's host address is 0"); return -1; }
  if (g->ds != NULL || g->marks.obj != NULL) { PyErr_SetString(PyExc_RuntimeError, "GraphRun is made once"); return -1; }
  if (PyObject_GetBuffer(marks, &g->marks, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
  if (g->marks.itemsize != 8 || strcmp(g->marks.format, "Q") != 0 || g->marks.len < (GS_LAST_RUN + GS_LAST_RUN_WORDS) * 8) {
    PyBuffer_Release(&g->marks);
    PyErr_SetString(PyExc_ValueError, "GraphRun: the run state must be an array('Q') of hcq.graph_state's words");
    return -1;
  }
  PyObject *lock = PyObject_GetAttrString(ring, "lock"), *handle = PyObject_GetAttrString(ring, "handle");
  PyObject *tl = PyObject_GetAttr(((DeviceState *)ds)->dev, s_timeline_signal);
  int ok = lock && handle && tl && Py_IS_TYPE(lock, &RingLockType) && PyTuple_GET_SIZE(words) == 6 &&
           PyTuple_GET_SIZE(slots) <= 64 && PyTuple_GET_SIZE(sigs) <= 64 && address && kick && kick_ts;
  if (ok) g->tl_addr = u64_attr(tl, s_value_addr, &ok);
  if (ok) {
    g->ring_handle = PyLong_AsVoidPtr(handle);
    for (int i = 0; i < 6; i++) g->words[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(words, i));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sigs); i++) {
      unsigned long long v, t;
      if (!PyArg_ParseTuple(PyTuple_GET_ITEM(sigs, i), "KK", &v, &t) || !v || !t) { ok = 0; break; }
      g->sig_words[i] = (_Atomic uint64_t *)(uintptr_t)v; g->sig_ts[i] = (_Atomic uint64_t *)(uintptr_t)t; g->nsigs = (int)i + 1;
    }
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(slots); i++) {
      Slot *sl = &g->slots[i];
      unsigned long long w;
      if (!PyArg_ParseTuple(PyTuple_GET_ITEM(slots, i), "Ki", &w, &sl->which) || !w || sl->which < 0 || sl->which > 2) {
        ok = 0;
        break;
      }
      sl->word = (uint64_t *)(uintptr_t)w;
      g->nslots = (int)i + 1;
    }
    if (PyErr_Occurred() || g->ring_handle == NULL) ok = 0;
  }
  if (ok && ((g->count = fence_word_view(count, &g->count_view, "GraphRun: the ring's count")) == NULL ||
             (g->fence = fence_word_view(fence, &g->fence_view, "GraphRun: the queue's last fence")) == NULL ||
             (g->last = fence_word_view(last, &g->last_view, "GraphRun: its last submission")) == NULL)) {
    fence_word_release(&g->count_view);
    fence_word_release(&g->fence_view);
    g->count = g->fence = NULL;
    ok = 0;
  }
  if (!ok) {
    Py_XDECREF(lock); Py_XDECREF(handle); Py_XDECREF(tl);
    PyBuffer_Release(&g->marks);
    g->nslots = 0;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "GraphRun: a one-queue graph on a ring with a RingLock, and host addresses, are needed");
    return -1;
  }
  Py_DECREF(handle);
  g->lock = (RingLock *)lock;
  Py_INCREF(keep); g->keepalive = keep; g->tl_signal = tl;
  Py_INCREF(ds); g->ds = (DeviceState *)ds;
  g->submit = (submit_fn)(uintptr_t)address;
  g->kick_word = (_Atomic uint64_t *)(uintptr_t)kick; g->kick_ts = (_Atomic uint64_t *)(uintptr_t)kick_ts;
  Py_INCREF(run_lock); g->run_lock = (RingLock *)run_lock;
  g->tl_word = (uint64_t *)(uintptr_t)tl_word;
  return 0;
}

/* A host store of a signal (hcq.HCQSignal.store without the wake-up): the poison tag cleared first, then the value
 * with release, so a reader that sees the value sees the timestamp word as the store left it. */
static void host_store(_Atomic uint64_t *word, _Atomic uint64_t *ts, uint64_t v) {
  hcq_clear_poison(ts);
  atomic_store_explicit(word, v, memory_order_release);
}

/* Whether this run may be native: what the graph's RunPlan says (hcq.graph.RunPlan.holds, the rule, checked here on
 * the plan's facts: the same input objects, none freed, the same variables, the device open on the same timeline
 * signal), and nothing capturing, profiling or validating. Notes the value the last run signals, which the run waits
 * for. */
static int graphrun_unchanged(GraphRun *g, PyObject *inputs, PyObject *vv) {
  if (gates_closed()) { PyErr_Clear(); return 0; }
  if (g->inputs == NULL || !PyTuple_CheckExact(inputs) || PyTuple_GET_SIZE(inputs) != PyTuple_GET_SIZE(g->inputs)) return 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); i++) if (PyTuple_GET_ITEM(inputs, i) != PyTuple_GET_ITEM(g->inputs, i)) return 0;
  int ok = vv == Py_None ? PyDict_GET_SIZE(g->user_vals) == 0 : PyDict_CheckExact(vv) && PyObject_RichCompareBool(vv, g->user_vals, Py_EQ) == 1;
  ok = ok && g->ds->w[DS_OPEN] && g->ds->w[DS_TIMELINE_ADDRESS] == g->tl_addr;
  uint64_t frees = ok ? PyLong_AsUnsignedLongLong(PyList_GET_ITEM(g->frees_list, 0)) : 0;
  if (ok && frees != g->frees) {  /* something was freed since the inputs were seen live: look at them again */
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(inputs); i++) {
      PyObject *root = PyObject_GetAttr(PyTuple_GET_ITEM(inputs, i), s_root), *freed = root ? PyObject_GetAttr(root, s_freed) : NULL;
      ok = freed == Py_False;
      Py_XDECREF(root); Py_XDECREF(freed);
    }
    if (ok) g->frees = frees;
  }
  /* the value the last run signals on this timeline signal (this run waits for it before patching); none yet, or on
   * another signal: the Python path */
  const uint64_t *marks = g->marks.buf;
  ok = ok && marks[GS_LAST_RUN] == g->tl_addr;
  g->last_wanted = ok ? marks[GS_LAST_RUN + 1] : 0;
  if (PyErr_Occurred()) ok = 0;
  PyErr_Clear();
  return ok;
}

static PyObject *graphrun_locked(GraphRun *g, PyObject *inputs, PyObject *vv_given) {
  if (!graphrun_unchanged(g, inputs, vv_given)) Py_RETURN_FALSE;
  /* a timeline stored by a failed device: the Python path's wait raises DeviceError, saying what failed */
  if (hcq_is_poisoned(__atomic_load_n(g->tl_word + 1, __ATOMIC_ACQUIRE))) Py_RETURN_FALSE;
  if (__atomic_load_n(g->tl_word, __ATOMIC_ACQUIRE) < g->last_wanted) {  /* the last run still runs: its words are in use */
    PyObject *r = PyObject_CallMethod(g->tl_signal, "wait", "K", (unsigned long long)g->last_wanted);  /* (timeout, Ctrl-C, failures) */
    if (r == NULL) return NULL;
    Py_DECREF(r);
  }
  uint64_t *marks = g->marks.buf;
  uint64_t kv = marks[GS_KICKOFF] + 1, tv = devstate_timeline(g->ds), count = 0;
  if (PyErr_Occurred() || tv == 0) { PyErr_Clear(); Py_RETURN_FALSE; }
  if (ringlock_take(g->lock, 0) != 1) Py_RETURN_FALSE;
  count = *g->count + 1;
  uint64_t value[3] = {kv, tv - 1, tv};
  for (int i = 0; i < g->nslots; i++) __atomic_store_n(g->slots[i].word, value[g->slots[i].which], __ATOMIC_RELAXED);
  for (int i = 0; i < g->nsigs; i++) host_store(g->sig_words[i], g->sig_ts[i], 0);
  host_store(g->kick_word, g->kick_ts, kv);  /* one submission: its gate opens first */
  uint64_t w[6];
  memcpy(w, g->words, sizeof w);
  w[5] = count;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = g->submit(g->ring_handle, w, 6, SUBMIT_SLICE_NS);
  Py_END_ALLOW_THREADS
  if (rc != SUBMIT_OK) { ringlock_give(g->lock); Py_RETURN_FALSE; }
  /* the bookkeeping of _submit_to_ring (the fence words; this run holds the queue's keepalive) and _submit_run; the
   * graph's per-run values it catches up from the run state words when Python runs it next (HCQGraph._catch_up) */
  marks[GS_KICKOFF] = kv;
  marks[GS_LAST_RUN + 1] = tv;
  *g->count = *g->fence = *g->last = count;
  int bad = devstate_submitted(g->ds, tv) < 0;
  ringlock_give(g->lock);
  if (bad) return NULL;  /* out of memory after the submission: say so rather than carry on out of step */
  Py_RETURN_TRUE;
}

/* use(plan, frees_list): the RunPlan the native runs follow from now on (None: none, every run is Python's) */
static PyObject *graphrun_use(GraphRun *g, PyObject *args) {
  PyObject *plan, *frees_list, *inputs = NULL, *user = NULL, *frees = NULL;
  if (!PyArg_ParseTuple(args, "OO!", &plan, &PyList_Type, &frees_list)) return NULL;
  if (PyList_GET_SIZE(frees_list) < 1) { PyErr_SetString(PyExc_ValueError, "use: FREES holds one count"); return NULL; }
  if (plan != Py_None) {
    inputs = PyObject_GetAttrString(plan, "inputs");
    user = inputs ? PyObject_GetAttrString(plan, "user_vals") : NULL;
    frees = user ? PyObject_GetAttrString(plan, "frees") : NULL;
    if (frees == NULL || !PyTuple_CheckExact(inputs) || !PyDict_CheckExact(user) || !PyLong_Check(frees)) {
      Py_XDECREF(inputs); Py_XDECREF(user); Py_XDECREF(frees);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "use: a RunPlan (inputs tuple, user_vals dict, frees int) or None");
      return NULL;
    }
    g->frees = PyLong_AsUnsignedLongLong(frees);
    Py_DECREF(frees);
    if (PyErr_Occurred()) { Py_DECREF(inputs); Py_DECREF(user); return NULL; }
  }
  Py_XSETREF(g->inputs, inputs);
  Py_XSETREF(g->user_vals, user);
  Py_INCREF(frees_list);
  Py_XSETREF(g->frees_list, frees_list);
  Py_RETURN_NONE;
}

static PyMethodDef graphrun_methods[] = {
  {"use", (PyCFunction)graphrun_use, METH_VARARGS, "use(plan, frees_list): the RunPlan native runs follow (None: none)"},
  {NULL, NULL, 0, NULL},
};

/* run(inputs, var_vals) -> True (the run is in) / False (nothing submitted: the Python path runs it) */
static PyObject *graphrun_call(GraphRun *g, PyObject *args, PyObject *kwargs) {
  PyObject *inputs, *vv;
  if (g->ds == NULL) { PyErr_SetString(PyExc_TypeError, "GraphRun was not made (its __init__ did not succeed)"); return NULL; }
  if (kwargs != NULL || !PyArg_UnpackTuple(args, "run", 2, 2, &inputs, &vv)) return NULL;
  if (ringlock_take(g->run_lock, 0) != 1) Py_RETURN_FALSE;  /* the graph's own run lock (another thread runs it) */
  PyObject *res = graphrun_locked(g, inputs, vv);
  ringlock_give(g->run_lock);
  return res;
}
static PyTypeObject GraphRunType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "hcq._hotpath.GraphRun",
  .tp_basicsize = sizeof(GraphRun),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
  .tp_doc = "GraphRun(...): the native run of a one-queue HCQGraph when only the kickoff and timeline values change",
  .tp_weaklistoffset = offsetof(GraphRun, weakrefs),
  .tp_new = PyType_GenericNew,
  .tp_init = (initproc)graphrun_init,
  .tp_call = (ternaryfunc)graphrun_call,
  .tp_methods = graphrun_methods,
  .tp_traverse = (traverseproc)graphrun_traverse,
  .tp_clear = (inquiry)graphrun_clear,
  .tp_dealloc = (destructor)graphrun_dealloc,
};

/* ------------------------------------------------------------------------------------------------ host copies */
enum { HOST_COPY_NOGIL_BYTES = 64 << 10 };  /* larger copies let other threads run meanwhile */

/* hcq_host_copy, with the GIL released for a large copy (the caller holds buffer exports of both ranges). */
static void host_copy_bytes(void *dst, const void *src, size_t n) {
  if (n < HOST_COPY_NOGIL_BYTES) { hcq_host_copy(dst, src, n); return; }
  Py_BEGIN_ALLOW_THREADS
  hcq_host_copy(dst, src, n);
  Py_END_ALLOW_THREADS
}

/* host_copy(dst, src): hcq_host_copy between two C-contiguous buffers of the same length (hcq/hostcopy.py). */
static PyObject *host_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "host_copy(dst, src) takes 2 arguments, got %zd", nargs);
    return NULL;
  }
  Py_buffer dst, src;
  if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
    PyBuffer_Release(&dst);
    return NULL;
  }
  PyObject *ret = Py_None;
  if (dst.len != src.len) {
    PyErr_Format(PyExc_ValueError, "host copy: %zd bytes do not fit %zd", src.len, dst.len);
    ret = NULL;
  } else {
    host_copy_bytes(dst.buf, src.buf, (size_t)dst.len);
  }
  PyBuffer_Release(&src);
  PyBuffer_Release(&dst);
  return Py_XNewRef(ret);
}

/* timeline_ring_take(state, tags, ntags, ring_size, seg_size, need, size, tag, alignment, waited): hcq_timeline_ring_take on
 * a TimelineRing's arrays, given by address (hcq/timeline_ring.py, the only caller, passes its own arrays' addresses). */
static PyObject *timeline_ring_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_Format(PyExc_TypeError, "timeline_ring_take takes 10 arguments, got %zd", nargs);
    return NULL;
  }
  int64_t v[10];
  for (int i = 0; i < 10; i++) {
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return NULL;
  }
  if (!v[0] || !v[1] || !v[5]) {
    PyErr_SetString(PyExc_ValueError, "timeline_ring_take: a null array address");
    return NULL;
  }
  return PyLong_FromLongLong(hcq_timeline_ring_take((int64_t *)(uintptr_t)v[0], (int64_t *)(uintptr_t)v[1], v[2], v[3], v[4],
                                                    v[6], v[7], v[8], v[9], (int64_t *)(uintptr_t)v[5]));
}

/* ------------------------------------------------------------------------------------------------ HostCopier */
/* An allocator's copyin or copyout (hcq/allocator.py's HCQAllocator._fast_host_copies): a small host copy on a device
 * that is idle, open and not failed, with the checks of the Python method, in one call. Anything else (an argument the
 * fast path does not take, a profiler, capture or validation, a device with work in flight or a failure, a copy the
 * copy engine makes) calls the Python method with the same arguments, which does it or raises saying why. Nothing is
 * read or written before that decision. */
static PyObject *s_value_mv, *s_ts_mv, *s_error_state, *s_view, *s_raw, *s_host_copy_max;

typedef struct {
  PyObject_HEAD
  DeviceState *ds;
  PyObject *alloc, *buffer_type, *fallback;
  int copyin, has_copy_queues;
  const int *failed;  /* the executor's failed flag (nonzero once it failed) */
  /* the timeline signal the words below were read from (it changes when the timeline wraps) */
  PyObject *tl_signal;
  Py_buffer tl_value, tl_ts;
} HostCopier;

static void hostcopier_release_signal(HostCopier *c) {
  if (c->tl_signal == NULL) return;
  PyBuffer_Release(&c->tl_value);
  PyBuffer_Release(&c->tl_ts);
  Py_CLEAR(c->tl_signal);
}

static int hostcopier_traverse(HostCopier *c, visitproc visit, void *arg) {
  Py_VISIT((PyObject *)c->ds); Py_VISIT(c->alloc); Py_VISIT(c->buffer_type); Py_VISIT(c->fallback); Py_VISIT(c->tl_signal);
  return 0;
}

static int hostcopier_clear(HostCopier *c) {
  hostcopier_release_signal(c);
  Py_CLEAR(c->ds); Py_CLEAR(c->alloc); Py_CLEAR(c->buffer_type); Py_CLEAR(c->fallback);
  return 0;
}

static void hostcopier_dealloc(HostCopier *c) {
  PyObject_GC_UnTrack(c);
  hostcopier_clear(c);
  Py_TYPE(c)->tp_free((PyObject *)c);
}

static int hostcopier_init(HostCopier *c, PyObject *args, PyObject *kwargs) {
  static char *kw[] = {"device_state", "alloc", "buffer_type", "fallback", "copyin", "has_copy_queues", "failed_flag", NULL};
  PyObject *ds, *alloc, *btype, *fallback;
  int copyin, has_copy;
  unsigned long long failed;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOppK", kw, &DeviceStateType, &ds, &alloc, &btype, &fallback, &copyin, &has_copy, &failed)) return -1;
  if (!PyType_Check(btype) || !PyCallable_Check(fallback)) { PyErr_SetString(PyExc_TypeError, "HostCopier: buffer_type must be a type and fallback callable"); return -1; }
  if (!failed || failed % sizeof(int)) { PyErr_SetString(PyExc_ValueError, "HostCopier: failed_flag must be the aligned address of an int"); return -1; }
  hostcopier_clear(c);
  Py_INCREF(ds); c->ds = (DeviceState *)ds;
  Py_INCREF(alloc); c->alloc = alloc;
  Py_INCREF(btype); c->buffer_type = btype;
  Py_INCREF(fallback); c->fallback = fallback;
  c->copyin = copyin; c->has_copy_queues = has_copy;
  c->failed = (const int *)(uintptr_t)failed;
  return 0;
}

/* Views of the timeline signal's value and timestamp words ('Q' memoryviews `_value_mv`, `_ts_mv`); 0 for a signal
 * without them (a virtual one: the Python path). */
static int hostcopier_read_signal(HostCopier *c, PyObject *sig) {
  hostcopier_release_signal(c);
  PyObject *v = PyObject_GetAttr(sig, s_value_mv), *t = PyObject_GetAttr(sig, s_ts_mv);
  if (v && t && v != Py_None && t != Py_None && PyObject_GetBuffer(v, &c->tl_value, PyBUF_SIMPLE) == 0) {
    if (PyObject_GetBuffer(t, &c->tl_ts, PyBUF_SIMPLE) == 0) {
      if (c->tl_value.len == 8 && c->tl_ts.len == 8 && (uintptr_t)c->tl_value.buf % 8 == 0 && (uintptr_t)c->tl_ts.buf % 8 == 0) {
        Py_INCREF(sig); c->tl_signal = sig;
      } else {
        PyBuffer_Release(&c->tl_ts); PyBuffer_Release(&c->tl_value);
      }
    } else {
      PyBuffer_Release(&c->tl_value);
    }
  }
  Py_XDECREF(v); Py_XDECREF(t);
  PyErr_Clear();
  return c->tl_signal != NULL;
}

/* Whether the device is open, not failed and done with every submission (what wait_timeline waits for). */
static int hostcopier_device_idle(HostCopier *c) {
  int idle = 0;
  PyObject *err = PyObject_GetAttr(c->ds->dev, s_error_state), *sig = PyObject_GetAttr(c->ds->dev, s_timeline_signal);
  if (err == Py_None && sig && (sig == c->tl_signal || hostcopier_read_signal(c, sig))) {
    uint64_t want = c->ds->w[DS_TIMELINE_VALUE];
    if (want >= 1) {
      /* acquire: the device's writes before it stored the value are seen by the copy below */
      uint64_t have = __atomic_load_n((const uint64_t *)c->tl_value.buf, __ATOMIC_ACQUIRE);
      uint64_t ts = __atomic_load_n((const uint64_t *)c->tl_ts.buf, __ATOMIC_RELAXED);
      idle = have >= want - 1 && !hcq_is_poisoned(ts) && __atomic_load_n(c->failed, __ATOMIC_ACQUIRE) == 0;
    }
  }
  Py_XDECREF(err); Py_XDECREF(sig);
  PyErr_Clear();
  return idle;
}

/* The buffer's host window and size if it is a live allocation or view of this device (writable, for a copyin) the fast
 * path takes. A buffer of another device is the method's to refuse: this device's timeline does not order its work. */
static int hostcopier_window(HostCopier *c, PyObject *buf, Py_buffer *win, Py_ssize_t *size) {
  int ok = 0;
  PyObject *root = PyObject_GetAttr(buf, s_root), *view = PyObject_GetAttr(buf, s_view), *sz = PyObject_GetAttr(buf, s_size);
  PyObject *freed = root ? PyObject_GetAttr(root, s_freed) : NULL, *ro = root ? PyObject_GetAttr(root, s_readonly) : NULL;
  PyObject *owner = root ? PyObject_GetAttr(root, s_owner) : NULL;
  PyObject *raw = view && view != Py_None ? PyObject_GetAttr(view, s_raw) : NULL;
  if (freed == Py_False && owner == c->ds->dev && (ro == Py_False || !c->copyin) && raw && sz && PyLong_CheckExact(sz)) {
    *size = PyLong_AsSsize_t(sz);
    ok = !PyErr_Occurred() && PyObject_GetBuffer(raw, win, c->copyin ? PyBUF_WRITABLE : PyBUF_SIMPLE) == 0;
  }
  Py_XDECREF(root); Py_XDECREF(view); Py_XDECREF(sz); Py_XDECREF(freed); Py_XDECREF(ro); Py_XDECREF(owner); Py_XDECREF(raw);
  PyErr_Clear();
  return ok;
}

/* The host buffer, contiguous (writable for a copyout); 0 when it offers none such (the Python method says why), -1
 * on any other error (a KeyboardInterrupt out of a Python-level buffer export is not swallowed). */
static int hostcopier_host_buffer(HostCopier *c, PyObject *host, Py_buffer *mem) {
  if (PyObject_GetBuffer(host, mem, c->copyin ? PyBUF_C_CONTIGUOUS : PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) return 1;
  if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
  PyErr_Clear();
  return 0;
}

/* 1: copied; 0: the Python method's turn; -1: an error is set. The host buffer is taken first (as the method does), so
 * nothing a Python-level export runs can free the device buffer after it was checked. */
static int hostcopier_try(HostCopier *c, PyObject *buf, PyObject *host) {
  if (Py_TYPE(buf) != (PyTypeObject *)c->buffer_type) return 0;
  Py_buffer win, mem;
  Py_ssize_t size;
  int got = hostcopier_host_buffer(c, host, &mem);
  if (got <= 0) return got;
  if (!hostcopier_window(c, buf, &win, &size)) {
    PyBuffer_Release(&mem);
    return 0;
  }
  int done = 0;
  Py_ssize_t n = mem.len;
  if (n > 0 && n <= size && n <= win.len) {
    int fits = !c->has_copy_queues;
    if (!fits) {
      PyObject *max = PyObject_GetAttr(c->alloc, s_host_copy_max);
      fits = max && PyLong_CheckExact(max) && n <= PyLong_AsSsize_t(max) && !PyErr_Occurred();
      Py_XDECREF(max);
      PyErr_Clear();
    }
    if (fits && hostcopier_device_idle(c)) {
      host_copy_bytes(c->copyin ? win.buf : mem.buf, c->copyin ? mem.buf : win.buf, (size_t)n);
      done = 1;
    }
  }
  PyBuffer_Release(&mem);
  PyBuffer_Release(&win);
  return done;
}

static PyObject *hostcopier_call(HostCopier *c, PyObject *args, PyObject *kwargs) {
  if (c->fallback == NULL) { PyErr_SetString(PyExc_TypeError, "HostCopier was not made (its __init__ did not succeed)"); return NULL; }
  if ((kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0) && PyTuple_GET_SIZE(args) == 2) {
    int g = gates_closed();
    if (g < 0) return NULL;
    if (!g) {
      PyObject *a = PyTuple_GET_ITEM(args, 0), *b = PyTuple_GET_ITEM(args, 1);
      int r = hostcopier_try(c, c->copyin ? a : b, c->copyin ? b : a);
      if (r < 0) return NULL;
      if (r) Py_RETURN_NONE;
    }
  }
  return PyObject_Call(c->fallback, args, kwargs);
}

static PyTypeObject HostCopierType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "hcq._hotpath.HostCopier",
  .tp_basicsize = sizeof(HostCopier),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
  .tp_doc = "HostCopier(device_state, alloc, buffer_type, fallback, copyin, has_copy_queues, failed_flag): "
            "an allocator's copyin or copyout, small host copies on an idle device done natively",
  .tp_new = PyType_GenericNew,
  .tp_init = (initproc)hostcopier_init,
  .tp_call = (ternaryfunc)hostcopier_call,
  .tp_traverse = (traverseproc)hostcopier_traverse,
  .tp_clear = (inquiry)hostcopier_clear,
  .tp_dealloc = (destructor)hostcopier_dealloc,
};

/* ------------------------------------------------------------------------------------------------ module */
static PyMethodDef methods[] = {
  {"submitter", submitter, METH_O, "submitter(address) -> submit(ring, words_address, nwords, timeout_ns) -> status"},
  {"waiter", waiter, METH_O, "waiter(address) -> wait(address, value, timeout_ns) -> status"},
  {"host_copy", (PyCFunction)(void (*)(void))host_copy, METH_FASTCALL, "host_copy(dst, src): copy src's bytes into dst (same length)"},
  {"timeline_ring_take", (PyCFunction)(void (*)(void))timeline_ring_take, METH_FASTCALL,
   "timeline_ring_take(state, tags, ntags, ring_size, seg_size, need, size, tag, alignment, waited) -> offset, -2 (wait for *need) or -1"},
  {"set_gates", set_gates, METH_O, "set_gates(((dict, name), ...)): the fast path runs only while each is None, False or 0"},
  {"set_submit_slice", set_submit_slice, METH_O, "set_submit_slice(ns): how long a native submit waits for ring space before Python looks (hcq.packet_queue.SUBMIT_SLICE_NS)"},
  {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "hcq._hotpath", "hcq's launch hot path (optional)", -1, methods,
                                        NULL, NULL, NULL, NULL};

static int intern_all(void) {
  struct { PyObject **slot; const char *text; } names[] = {
    {&s_global_size, "global_size"}, {&s_local_size, "local_size"}, {&s_vals, "vals"}, {&s_wait, "wait"},
    {&s_timeout, "timeout"}, {&s_launch, "launch"}, {&s_native_plan, "_native_plan"}, {&s_dims_words, "dims_words"},
    {&s_timeline_signal, "timeline_signal"}, {&s_value_addr, "value_addr"},
    {&s_root, "_root"}, {&s_freed, "_freed"}, {&s_readonly, "_readonly"}, {&s_owner, "owner"}, {&s_va_addr, "va_addr"}, {&s_state, "state"}, {&s_seg_tags, "seg_tags"},
    {&s_seg_size, "seg_size"}, {&s_size, "size"}, {&s_alignment, "ALIGNMENT"}, 
    {&s_value_mv, "_value_mv"}, {&s_ts_mv, "_ts_mv"}, {&s_error_state, "error_state"},
    {&s_view, "view"}, {&s_raw, "raw"}, {&s_host_copy_max, "host_copy_max"}, {&s_q, "_q"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return -1;
  return (default_dims = Py_BuildValue("(iii)", 1, 1, 1)) == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__hotpath(void) {
  if (intern_all() < 0 || PyType_Ready(&DeviceStateType) < 0 || PyType_Ready(&LauncherType) < 0 || PyType_Ready(&LaunchableType) < 0 || PyType_Ready(&ResubmitType) < 0 ||
      PyType_Ready(&RingLockType) < 0 || PyType_Ready(&GraphRunType) < 0 ||
      PyType_Ready(&HostCopierType) < 0) return NULL;
  PyObject *m = PyModule_Create(&module_def);
  if (m == NULL) return NULL;
  Py_INCREF(&DeviceStateType);
  Py_INCREF(&LauncherType);
  Py_INCREF(&LaunchableType);
  Py_INCREF(&ResubmitType);
  Py_INCREF(&RingLockType);
  Py_INCREF(&GraphRunType);
  Py_INCREF(&HostCopierType);
  if (PyModule_AddObject(m, "DeviceState", (PyObject *)&DeviceStateType) < 0 || PyModule_AddObject(m, "Launcher", (PyObject *)&LauncherType) < 0 || PyModule_AddObject(m, "Launchable", (PyObject *)&LaunchableType) < 0 ||
      PyModule_AddObject(m, "Resubmit", (PyObject *)&ResubmitType) < 0 || PyModule_AddObject(m, "RingLock", (PyObject *)&RingLockType) < 0 ||
      PyModule_AddObject(m, "GraphRun", (PyObject *)&GraphRunType) < 0 || PyModule_AddObject(m, "HostCopier", (PyObject *)&HostCopierType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
