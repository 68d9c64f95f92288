"""Kernels on the CPU device: compile errors, parameter parsing and the kernargs layout, argument
checking, the built-in ids, launches (timing, big grids), the on-disk compile cache and CC."""
import ctypes
import json
import os
import uuid

import numpy as np
import pytest

import hcq
from hcq import BufferSpec
from hcq import toolchain

SPEC = BufferSpec(cpu_access=True)


def alloc(dev, n):
    return dev.allocator.alloc(n, SPEC)


def read(buf, dtype, n=None):
    arr = np.frombuffer(buf.cpu_view().mv, dtype)
    return arr.copy() if n is None else arr[:n].copy()


# ---------------------------------------------------------------- compile errors
def test_syntax_error_raises_compile_error(dev):
    with pytest.raises(hcq.CompileError, match=r"(?s)error:.*expected"):
        dev.compile("HCQ_KERNEL void k(int *o) { o[0] = 1 }", "k")


def test_undefined_identifier_raises_compile_error(dev):
    with pytest.raises(hcq.CompileError, match="undefined_thing_xyz"):
        dev.compile("HCQ_KERNEL void k(int *o) { o[0] = undefined_thing_xyz; }", "k")


def test_undeclared_function_raises_compile_error(dev):
    with pytest.raises(hcq.CompileError, match="no_such_function_q"):
        dev.compile("HCQ_KERNEL void k(int *o) { o[0] = no_such_function_q(3); }", "k")


def test_compile_error_message_points_at_kernel_source_line(dev):
    src = "HCQ_KERNEL void k(int *o) {\n  int a = 1;\n  o[0] = a +;\n}\n"
    with pytest.raises(hcq.CompileError, match=r"kernel\.c:3:"):
        dev.compile(src, "k")


def test_no_kernel_raises_compile_error(dev):
    with pytest.raises(hcq.CompileError, match="HCQ_KERNEL"):
        dev.compile("void k(int *o) { o[0] = 1; }", "k")


@pytest.mark.parametrize("dead", ["// HCQ_KERNEL void old_k(int *o) { o[0] = 0; }",
                                  "/* HCQ_KERNEL void old_k(int *o) { o[0] = 0; } */",
                                  "/*\n   an older version:\n   HCQ_KERNEL void old_k(int *o, int n)\n*/"])
def test_commented_out_kernel_is_ignored(dev, dead):
    """A kernel inside a comment is not a kernel: the live one compiles and runs."""
    src = f"{dead}\nHCQ_KERNEL void live(int *o) {{ o[0] = 42; }}\n"
    prg = dev.compile(src, "live")
    buf = alloc(dev, 8)
    try:
        prg(buf, wait=True)
        assert read(buf, np.int32)[0] == 42
    finally:
        dev.allocator.free(buf, 8, SPEC)


def test_kernel_defined_twice_raises(dev):
    with pytest.raises(hcq.CompileError, match="twice"):
        dev.compile("HCQ_KERNEL void k(int *o) { o[0] = 1; }\nHCQ_KERNEL void k(int *o) { o[0] = 2; }", "k")


def test_unknown_kernel_name_lists_names(dev):
    src = "HCQ_KERNEL void alpha(int *o) { o[0] = 1; }\nHCQ_KERNEL void beta(int *o) { o[0] = 2; }"
    with pytest.raises(ValueError, match=r"gamma.*alpha, beta"):
        dev.compile(src, "gamma")
    a, b = dev.compile(src, "alpha"), dev.compile(src, "beta")
    buf = alloc(dev, 8)
    try:
        a(buf, wait=True)
        assert read(buf, np.int32)[0] == 1
        b(buf, wait=True)
        assert read(buf, np.int32)[0] == 2
    finally:
        dev.allocator.free(buf, 8, SPEC)


@pytest.mark.parametrize("params,what", [("struct foo x", "struct foo"), ("int x[4]", "x"), ("long double v", "long double"),
                                         ("my_type_t t", "my_type_t"), ("float _Complex z", "_Complex")])
def test_unsupported_param_types_raise(dev, params, what):
    src = f"struct foo {{ int a; }}; typedef int my_type_t;\nHCQ_KERNEL void k(int *o, {params}) {{ o[0] = 1; }}"
    with pytest.raises(hcq.CompileError, match=r"(?s)kernel k.*" + what):
        dev.compile(src, "k")


def test_compile_type_errors(dev):
    with pytest.raises(TypeError):
        dev.compile(b"HCQ_KERNEL void k(int *o) { o[0] = 1; }", "k")
    with pytest.raises(TypeError):
        dev.compile("HCQ_KERNEL void k(int *o) { o[0] = 1; }", None)


# ---------------------------------------------------------------- parameters
MIXED_SRC = """
HCQ_KERNEL void mixed(int a, double *out, double d, uint8_t u, int64_t *o2, float f, unsigned b, long l,
                      int8_t i8, uint64_t *o3, int16_t i16, uint16_t u16, int32_t i32, uint32_t u32,
                      int64_t i64, uint64_t u64, size_t sz, const float *in) {
  out[0] = d; out[1] = f; out[2] = in[0] * f;
  o2[0] = a; o2[1] = u; o2[2] = b; o2[3] = l; o2[4] = i8; o2[5] = i16; o2[6] = u16; o2[7] = i32;
  o2[8] = u32; o2[9] = i64;
  o3[0] = u64; o3[1] = sz;
}
"""
MIXED_VALS = dict(a=-123456789, d=1 / 3, u=255, f=0.1, b=4_000_000_000, l=-(1 << 40) - 5, i8=-128, i16=-32768,
                  u16=65535, i32=-(1 << 31), u32=(1 << 32) - 1, i64=-(1 << 63), u64=(1 << 64) - 1, sz=(1 << 40) + 3)
MIXED_ORDER = ["a", "d", "u", "f", "b", "l", "i8", "i16", "u16", "i32", "u32", "i64", "u64", "sz"]


def check_mixed(out, o2, o3):
    v = MIXED_VALS
    assert read(out, np.float64, 3).tolist() == [v["d"], float(np.float32(v["f"])), float(np.float32(2.5) * np.float32(v["f"]))]
    assert read(o2, np.int64, 10).tolist() == [v["a"], v["u"], v["b"], v["l"], v["i8"], v["i16"], v["u16"], v["i32"], v["u32"], v["i64"]]
    assert read(o3, np.uint64, 2).tolist() == [v["u64"], v["sz"]]


@pytest.fixture
def mixed_bufs(dev):
    bufs = [alloc(dev, 64), alloc(dev, 128), alloc(dev, 16), alloc(dev, 4)]
    for b in bufs: b.cpu_view()[:] = bytes(b.size)
    bufs[3].cpu_view().view(fmt="f")[0] = 2.5
    yield bufs
    for b in bufs: dev.allocator.free(b, b.size, SPEC)


def test_mixed_params_arrive(dev, mixed_bufs):
    prg = dev.compile(MIXED_SRC, "mixed")
    out, o2, o3, inp = mixed_bufs
    vals = tuple(MIXED_VALS[k] for k in MIXED_ORDER)
    t = prg(out, o2, o3, inp, vals=vals, wait=True)
    assert isinstance(t, float)
    check_mixed(out, o2, o3)


def test_mixed_params_arrive_through_queue(dev, mixed_bufs):
    """The checked path: fill_kernargs + exec on a compute queue."""
    prg = dev.compile(MIXED_SRC, "mixed")
    out, o2, o3, inp = mixed_bufs
    args = prg.fill_kernargs((out, o2, o3, inp), vals=tuple(MIXED_VALS[k] for k in MIXED_ORDER))
    assert isinstance(args, hcq.HCQArgsState) and isinstance(args, hcq.CLikeArgsState)
    dev.hw_compute_queue_t().wait(dev.timeline_signal, dev.timeline_value - 1).memory_barrier() \
       .exec(prg, args, (1, 1, 1), (1, 1, 1)).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    dev.synchronize()
    check_mixed(out, o2, o3)


_CTYPES = {"int": ctypes.c_int, "double": ctypes.c_double, "uint8_t": ctypes.c_uint8, "float": ctypes.c_float, "unsigned": ctypes.c_uint,
           "long": ctypes.c_long, "int8_t": ctypes.c_int8, "int16_t": ctypes.c_int16, "uint16_t": ctypes.c_uint16, "int32_t": ctypes.c_int32,
           "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
           "unsigned int": ctypes.c_uint, "long long": ctypes.c_longlong, "unsigned long": ctypes.c_ulong, "char": ctypes.c_char,
           "unsigned char": ctypes.c_ubyte, "short": ctypes.c_short}


def ctypes_struct(prg):
    fields = [(s.name, ctypes.c_void_p if s.is_pointer else _CTYPES[s.ctype]) for s in prg.arg_slots]
    return type("Args", (ctypes.Structure,), {"_fields_": fields})


def test_arg_slots_match_ctypes_struct(dev, mixed_bufs):
    prg = dev.compile(MIXED_SRC, "mixed")
    names = [s.name for s in prg.arg_slots]
    assert names == ["a", "out", "d", "u", "o2", "f", "b", "l", "i8", "o3", "i16", "u16", "i32", "u32", "i64", "u64", "sz", "in"]
    assert [s.is_pointer for s in prg.arg_slots] == [n in ("out", "o2", "o3", "in") for n in names]
    S = ctypes_struct(prg)
    assert [s.offset for s in prg.arg_slots] == [getattr(S, n).offset for n in names]
    assert prg.kernargs_alloc_size == ctypes.sizeof(S)
    # and fill_kernargs writes each value where the struct has it
    out, o2, o3, inp = mixed_bufs
    args = prg.fill_kernargs((out, o2, o3, inp), vals=tuple(MIXED_VALS[k] for k in MIXED_ORDER))
    st = S.from_buffer_copy(args.buf.cpu_view()[0:ctypes.sizeof(S)])
    assert (st.out, st.o2, st.o3, getattr(st, "in")) == (out.va_addr, o2.va_addr, o3.va_addr, inp.va_addr)
    for k in MIXED_ORDER:
        got = getattr(st, k)
        want = float(np.float32(MIXED_VALS[k])) if k == "f" else MIXED_VALS[k]
        assert got == want, k


@pytest.mark.parametrize("decl", ["char c, short s, double *o, unsigned char uc, long long ll",
                                  "const double d, float *restrict o, unsigned int ui, unsigned long ul",
                                  "int8_t a, int8_t b, int8_t c, double *o, int16_t e"])
def test_arg_slots_layout_various(dev, decl):
    prg = dev.compile(f"HCQ_KERNEL void lay({decl}) {{ (void)o; }}", "lay")
    S = ctypes_struct(prg)
    assert [s.offset for s in prg.arg_slots] == [getattr(S, s.name).offset for s in prg.arg_slots]
    assert prg.kernargs_alloc_size == max(8, ctypes.sizeof(S))


@pytest.mark.parametrize("params", ["void", "", "  "])
def test_no_params_kernel(dev, params):
    prg = dev.compile(f"HCQ_KERNEL void noargs({params}) {{ }}", "noargs")
    assert prg.arg_slots == []
    assert isinstance(prg(wait=True), float)
    with pytest.raises(ValueError, match=r"noargs\(\) takes 0 buffer\(s\) and 0 value\(s\)"):
        prg(vals=(1,), wait=True)


# ---------------------------------------------------------------- argument checking
CHECK_SRC = "HCQ_KERNEL void chk(float *o, int n, const float *i, double s) { o[0] = i[0] * s + n; }"


@pytest.fixture
def chk(dev):
    prg = dev.compile(CHECK_SRC, "chk")
    bufs = (alloc(dev, 16), alloc(dev, 16))
    yield prg, bufs
    for b in bufs: dev.allocator.free(b, 16, SPEC)


@pytest.mark.parametrize("nbufs,vals", [(1, (1, 2.0)), (3, (1, 2.0)), (2, (1,)), (2, (1, 2.0, 3)), (0, ())])
def test_wrong_arg_counts(chk, nbufs, vals):
    prg, (a, b) = chk
    bufs = (a, b, a)[:nbufs]
    with pytest.raises(ValueError, match=r"chk\(.*2 buffer\(s\) and 2 value\(s\)"):
        prg.fill_kernargs(bufs, vals)
    with pytest.raises(ValueError, match=r"chk\("):
        prg(*bufs, vals=vals, wait=True)


WRONG_KINDS = {  # name -> (make (bufs, vals) from the two buffers, the parameter the error names)
    "int-for-buffer": (lambda a, b: ((a, 7), (1, 2.0)), "i"),
    "none-for-buffer": (lambda a, b: ((None, b), (1, 2.0)), "o"),
    "bytes-for-buffer": (lambda a, b: ((a, b"xx"), (1, 2.0)), "i"),
    "float-for-int": (lambda a, b: ((a, b), (1.5, 2.0)), "n"),
    "str-for-int": (lambda a, b: ((a, b), ("1", 2.0)), "n"),
    "bool-for-int": (lambda a, b: ((a, b), (True, 2.0)), "n"),
    "bool-for-double": (lambda a, b: ((a, b), (1, False)), "s"),
    "buffer-for-int": (lambda a, b: ((a, b), (a, 2.0)), "n"),
    "str-for-double": (lambda a, b: ((a, b), (1, "2")), "s"),
    "none-for-double": (lambda a, b: ((a, b), (1, None)), "s"),
}


@pytest.mark.parametrize("case", list(WRONG_KINDS))
def test_wrong_arg_kinds(chk, case):
    prg, (a, b) = chk
    make, param = WRONG_KINDS[case]
    bufs, vals = make(a, b)
    with pytest.raises(TypeError, match=rf"chk\(.*{param!r}"):
        prg.fill_kernargs(bufs, vals)
    with pytest.raises(TypeError, match=rf"chk\(.*{param!r}"):
        prg(*bufs, vals=vals, wait=True)


def test_good_args_after_bad_ones(chk):
    prg, (a, b) = chk
    with pytest.raises(TypeError):
        prg(a, b, vals=(1.5, 2.0), wait=True)
    b.cpu_view().view(fmt="f")[0] = 4.0
    prg(a, b, vals=(3, 0.5), wait=True)
    assert a.cpu_view().view(fmt="f")[0] == 5.0


def test_freed_buffer_arg_raises(dev, chk):
    prg, (a, b) = chk
    tmp = dev.allocator.alloc(16, BufferSpec(cpu_access=True, nolru=True))
    dev.allocator.free(tmp, 16, BufferSpec(cpu_access=True, nolru=True))
    with pytest.raises(ValueError, match=r"chk\(.*freed"):
        prg.fill_kernargs((tmp, b), (1, 2.0))
    with pytest.raises(ValueError, match=r"chk\(.*freed"):
        prg(tmp, b, vals=(1, 2.0), wait=True)


@pytest.mark.parametrize("decl,val", [("uint8_t v", 256), ("uint8_t v", -1), ("unsigned v", 1 << 32), ("int v", 1 << 31),
                                      ("int16_t v", -40000), ("uint64_t v", 1 << 64), ("size_t v", -1), ("int64_t v", 1 << 63)])
def test_out_of_range_scalar_raises(dev, decl, val):
    """A value that does not fit its parameter's type is refused (never silently truncated)."""
    prg = dev.compile(f"HCQ_KERNEL void rng(int *o, {decl}) {{ o[0] = (int)v; }}", "rng")
    buf = alloc(dev, 8)
    try:
        with pytest.raises((ValueError, OverflowError)):
            prg.fill_kernargs((buf,), (val,))
        with pytest.raises((ValueError, OverflowError)):
            prg(buf, vals=(val,), wait=True)
        prg(buf, vals=(1,), wait=True)  # the program still works with a good value
        assert read(buf, np.int32)[0] == 1
    finally:
        dev.allocator.free(buf, 8, SPEC)


def test_out_of_range_scalar_error_names_kernel_and_param(dev):
    """Like every other argument error, an out-of-range value names the kernel and the parameter."""
    prg = dev.compile("HCQ_KERNEL void rng8(int *o, uint8_t small) { o[0] = small; }", "rng8")
    buf = alloc(dev, 8)
    try:
        with pytest.raises((ValueError, OverflowError), match=r"rng8.*'small'"):
            prg.fill_kernargs((buf,), (256,))
        with pytest.raises((ValueError, OverflowError), match=r"rng8.*'small'"):
            prg(buf, vals=(256,), wait=True)
    finally:
        dev.allocator.free(buf, 8, SPEC)


def test_repeated_launch_same_args_checks_kinds(dev):
    """A launch whose values equal the previous launch's (1 == 1.0) is still checked: a float for an int
    parameter is refused even right after a launch with the same number as an int."""
    prg = dev.compile("HCQ_KERNEL void rep(double *o, double x, int n) { o[0] = x; o[1] = n; }", "rep")
    buf = alloc(dev, 16)
    try:
        prg(buf, vals=(0.5, 3), wait=True)
        with pytest.raises(TypeError, match=r"rep\(.*'n'"):
            prg(buf, vals=(0.5, 3.0), wait=True)
        prg(buf, vals=(0.25, 4), wait=True)  # and good ones still run
        assert read(buf, np.float64).tolist() == [0.25, 4.0]
    finally:
        dev.allocator.free(buf, 16, SPEC)


def test_negative_zero_reaches_kernel(dev):
    """-0.0 == 0.0 in Python, but a kernel can tell them apart: each launch gets the value it was given."""
    prg = dev.compile("HCQ_KERNEL void sgn(double *o, double x, float f) { o[0] = signbit(x) ? -1 : 1; o[1] = signbit(f) ? -1 : 1; }", "sgn")
    buf = alloc(dev, 16)
    try:
        for x, f in [(0.0, 0.0), (-0.0, -0.0), (0.0, -0.0), (-0.0, 0.0), (0.0, 0.0)]:
            prg(buf, vals=(x, f), wait=True)
            assert read(buf, np.float64).tolist() == [-1.0 if np.signbit(x) else 1.0, -1.0 if np.signbit(f) else 1.0], (x, f)
    finally:
        dev.allocator.free(buf, 16, SPEC)


def test_repeated_launches_same_args(dev):
    """Many pipelined launches with identical arguments, interleaved with another program's launches."""
    inc = dev.compile("HCQ_KERNEL void inc(int64_t *o, int64_t k) { o[hcq_global_id(0)] += k; }", "inc")
    other = dev.compile("HCQ_KERNEL void other(int64_t *o, int64_t k) { o[hcq_global_id(0)] = k; }", "other")
    n = 256
    a, b = alloc(dev, n * 8), alloc(dev, n * 8)
    try:
        a.cpu_view()[:] = bytes(n * 8)
        for i in range(300):
            inc(a, global_size=(n // 64, 1, 1), local_size=(64, 1, 1), vals=(3,))
            if i % 7 == 0: other(b, global_size=(n // 64, 1, 1), local_size=(64, 1, 1), vals=(i,))
        inc(a, global_size=(n // 64, 1, 1), local_size=(64, 1, 1), vals=(1000,))
        dev.synchronize()
        assert np.all(read(a, np.int64) == 900 + 1000)
        assert np.all(read(b, np.int64) == 294)
    finally:
        dev.allocator.free(a, n * 8, SPEC)
        dev.allocator.free(b, n * 8, SPEC)


def test_bad_grid_dims_raise(dev):
    prg = dev.compile("HCQ_KERNEL void g(int *o) { o[0] = 1; }", "g")
    buf = alloc(dev, 8)
    try:
        for gs, ls in [((0, 1, 1), (1, 1, 1)), ((1, 1, 1), (1, 0, 1)), ((-1, 1, 1), (1, 1, 1)), ((1, 1, 1, 1), (1, 1, 1))]:
            with pytest.raises(ValueError, match="dimensions"):
                prg(buf, global_size=gs, local_size=ls, wait=True)
        prg(buf, global_size=(1, 1, 1), local_size=(1, 1, 1), wait=True)  # the device is fine afterwards
    finally:
        dev.allocator.free(buf, 8, SPEC)


# ---------------------------------------------------------------- built-ins
IDS_SRC = """
HCQ_KERNEL void ids(int64_t *rec, unsigned *hits) {
  int64_t blk = (hcq_group_id(2) * hcq_num_groups(1) + hcq_group_id(1)) * hcq_num_groups(0) + hcq_group_id(0);
  int64_t thr = (hcq_local_id(2) * hcq_local_size(1) + hcq_local_id(1)) * hcq_local_size(0) + hcq_local_id(0);
  int64_t slot = blk * (hcq_local_size(0) * hcq_local_size(1) * hcq_local_size(2)) + thr;
  __atomic_fetch_add(&hits[slot], 1u, __ATOMIC_RELAXED);
  int64_t *r = rec + slot * 15;
  for (int d = 0; d < 3; d++) {
    r[d] = hcq_global_id(d); r[3 + d] = hcq_local_id(d); r[6 + d] = hcq_group_id(d);
    r[9 + d] = hcq_local_size(d); r[12 + d] = hcq_num_groups(d);
  }
}
"""


@pytest.mark.parametrize("gs,ls", [((3, 2, 2), (4, 2, 1)), ((1, 1, 1), (1, 1, 1)), ((5, 1, 3), (1, 3, 2)), ((64, 4, 2), (2, 1, 3))])
def test_builtin_ids(dev, gs, ls):
    prg = dev.compile(IDS_SRC, "ids")
    nblk, nthr = int(np.prod(gs)), int(np.prod(ls))
    n = nblk * nthr
    rec, hits = alloc(dev, n * 15 * 8), alloc(dev, n * 4)
    try:
        rec.cpu_view()[:] = b"\xff" * rec.size
        hits.cpu_view()[:] = bytes(hits.size)
        prg(rec, hits, global_size=gs, local_size=ls, wait=True)
        assert np.all(read(hits, np.uint32) == 1), "every (block, thread) runs exactly once"
        r = read(rec, np.int64).reshape(n, 15)
        expect = []
        for gz in range(gs[2]):
            for gy in range(gs[1]):
                for gx in range(gs[0]):
                    for lz in range(ls[2]):
                        for ly in range(ls[1]):
                            for lx in range(ls[0]):
                                grp, lid = (gx, gy, gz), (lx, ly, lz)
                                expect.append([grp[d] * ls[d] + lid[d] for d in range(3)] + list(lid) + list(grp) + list(ls) + list(gs))
        assert np.array_equal(r, np.array(expect, np.int64))
    finally:
        dev.allocator.free(rec, rec.size, SPEC)
        dev.allocator.free(hits, hits.size, SPEC)


HELPER_SRC = """
static int64_t helper_gid(void) { return hcq_global_id(0); }
__attribute__((noinline)) int64_t helper_noinline(int64_t k) { return hcq_global_id(0) * k + hcq_group_id(0) + hcq_local_id(0); }
HCQ_KERNEL void use_helpers(int64_t *a, int64_t *b) {
  size_t g = hcq_global_id(0);
  a[g] = helper_gid();
  b[g] = helper_noinline(1000);
}
"""


def test_helper_function_sees_builtins(dev):
    prg = dev.compile(HELPER_SRC, "use_helpers")
    nblk, lsz = 4096, 8
    n = nblk * lsz
    a, b = alloc(dev, n * 8), alloc(dev, n * 8)
    try:
        for rnd in range(2):
            a.cpu_view()[:] = b"\xff" * a.size
            prg(a, b, global_size=(nblk, 1, 1), local_size=(lsz, 1, 1), wait=True)
            g = np.arange(n, dtype=np.int64)
            assert np.array_equal(read(a, np.int64), g), f"round {rnd}"
            assert np.array_equal(read(b, np.int64), g * 1000 + g // lsz + g % lsz), f"round {rnd}"
    finally:
        dev.allocator.free(a, a.size, SPEC)
        dev.allocator.free(b, b.size, SPEC)


# ---------------------------------------------------------------- launches
SAXPY = """
HCQ_KERNEL void saxpy(float *out, const float *x, const float *y, float a, int n) {
  int i = (int)hcq_global_id(0);
  if (i < n) out[i] = a * x[i] + y[i];
}
"""


def test_call_returns_time_or_none(dev):
    prg = dev.compile(SAXPY, "saxpy")
    n = 1000
    out, x, y = alloc(dev, n * 4), alloc(dev, n * 4), alloc(dev, n * 4)
    try:
        xs, ys = np.arange(n, dtype=np.float32), np.full(n, 2, np.float32)
        dev.allocator.copyin(x, memoryview(xs))
        dev.allocator.copyin(y, memoryview(ys))
        t = prg(out, x, y, global_size=(-(-n // 64), 1, 1), local_size=(64, 1, 1), vals=(3.0, n), wait=True)
        assert isinstance(t, float) and 0 <= t < 10
        assert np.array_equal(read(out, np.float32), 3 * xs + ys)
        r = prg(out, x, y, global_size=(-(-n // 64), 1, 1), local_size=(64, 1, 1), vals=(-1.0, n), wait=False)
        assert r is None
        res = np.empty(n, np.float32)
        dev.allocator.copyout(memoryview(res), out)  # copyout waits for the kernel
        assert np.array_equal(res, -xs + ys)
    finally:
        for b in (out, x, y): dev.allocator.free(b, n * 4, SPEC)


def test_kernel_time_is_measured(dev):
    """wait=True returns device time: a kernel doing a lot of work reports more time than an empty one."""
    prg = dev.compile("HCQ_KERNEL void busy(double *o, int iters) { double x = o[0]; for (int i = 0; i < iters; i++) x = x * 0.999999 + 1e-6; o[0] = x; }", "busy")
    buf = alloc(dev, 8)
    try:
        buf.cpu_view().view(fmt="d")[0] = 0.25
        short = min(prg(buf, vals=(1,), wait=True) for _ in range(3))
        long_ = prg(buf, vals=(20_000_000,), wait=True)
        assert long_ > short and long_ > 1e-3
        assert long_ < 60
    finally:
        dev.allocator.free(buf, 8, SPEC)


def test_wait_with_deadline_gives_up_without_failing_the_device(dev):
    """prg(..., wait=True, timeout=ms): HCQTimeoutError once the deadline passes; the kernel runs on, the device stays
    usable (tinygrad's BEAM search times candidates this way). The kernel spins until the host opens its gate, so the
    timeout must fire while it still runs (no clock decides it: a wait that ignored its deadline would only return
    once the hang guard opened the gate, and then without raising)."""
    import threading
    src = """
HCQ_KERNEL void gated(int *gate, int *o, int v) {
  while (!__atomic_load_n(&gate[0], __ATOMIC_ACQUIRE)) {}
  o[0] = v;
}"""
    prg = dev.compile(src, "gated")
    gate, buf = alloc(dev, 8), alloc(dev, 8)
    g = np.frombuffer(gate.cpu_view().mv, np.int32)
    g[:] = 0
    np.frombuffer(buf.cpu_view().mv, np.int32)[:] = -1
    guard = threading.Timer(60, lambda: g.__setitem__(0, 1))  # hang guard only: a wait that ignores its deadline
    guard.start()
    try:
        with pytest.raises(hcq.HCQTimeoutError, match=r"timed out after 50 ms .*(?s:.*)EXEC of kernel 'gated'"):
            prg(gate, buf, vals=(400,), wait=True, timeout=50)  # the deadline asked for, not the 30 s default
        assert g[0] == 0 and read(buf, np.int32)[0] == -1, "the wait returned only after the kernel was let finish"
        g[0] = 1  # open the gate: not sticky, the kernel finishes and the device goes on
        dev.synchronize()
        assert read(buf, np.int32)[0] == 400
        assert prg(gate, buf, vals=(1,), wait=True, timeout=5000) > 0
        assert read(buf, np.int32)[0] == 1
        with pytest.raises(ValueError, match="timeout"):
            prg(gate, buf, vals=(1,), wait=True, timeout=-1)
    finally:
        guard.cancel()
        g[0] = 1
        dev.synchronize()
        dev.allocator.free(buf, 8, SPEC)
        dev.allocator.free(gate, 8, SPEC)


def test_pipelined_launches_run_in_order(dev):
    prg = dev.compile("HCQ_KERNEL void step(int64_t *o, int64_t k) { size_t i = hcq_global_id(0); o[i] = o[i] * 3 + k; }", "step")
    n = 512
    buf = alloc(dev, n * 8)
    try:
        buf.cpu_view()[:] = bytes(n * 8)
        expect = np.zeros(n, np.int64)
        for k in range(200):
            prg(buf, global_size=(n // 32, 1, 1), local_size=(32, 1, 1), vals=(k,))
            expect = expect * 3 + k
        dev.synchronize()
        assert np.array_equal(read(buf, np.int64), expect)
    finally:
        dev.allocator.free(buf, n * 8, SPEC)


def test_big_grid(dev):
    prg = dev.compile("""
HCQ_KERNEL void big(uint32_t *o, uint32_t mul, uint32_t add) {
  size_t g = hcq_global_id(0) + hcq_global_id(1) * hcq_num_groups(0) * hcq_local_size(0);
  o[g] = (uint32_t)g * mul + add;
}""", "big")
    nblk, lsz = 4096, 16
    n = nblk * lsz
    buf = alloc(dev, n * 4)
    try:
        g = np.arange(n, dtype=np.uint32)
        for mul, add in [(3, 1), (7, 100), (1, 0)]:
            buf.cpu_view()[:] = bytes(n * 4)
            prg(buf, global_size=(nblk, 1, 1), local_size=(lsz, 1, 1), vals=(mul, add), wait=True)
            assert np.array_equal(read(buf, np.uint32), g * np.uint32(mul) + np.uint32(add)), (mul, add)
        # the same with a 2-D grid of 64 x 64 blocks
        buf.cpu_view()[:] = bytes(n * 4)
        prg(buf, global_size=(64, 64, 1), local_size=(lsz, 1, 1), vals=(5, 9), wait=True)
        gx = np.arange(64 * lsz)
        expect = (np.arange(64)[:, None] * (64 * lsz) + gx[None, :]).reshape(-1).astype(np.uint32) * np.uint32(5) + np.uint32(9)
        assert np.array_equal(read(buf, np.uint32), expect)
    finally:
        dev.allocator.free(buf, n * 4, SPEC)


def test_big_grid_long_blocks(dev):
    """Blocks long enough that the worker pool takes part: each block's result is right exactly once."""
    prg = dev.compile("""
HCQ_KERNEL void acc(uint32_t *o, int iters) {
  uint32_t x = (uint32_t)hcq_group_id(0);
  for (int i = 0; i < iters; i++) x = x * 1103515245u + 12345u;
  __atomic_fetch_add(&o[hcq_group_id(0)], x, __ATOMIC_RELAXED);
}""", "acc")
    nblk, iters = 4096, 2000
    buf = alloc(dev, nblk * 4)
    try:
        buf.cpu_view()[:] = bytes(nblk * 4)
        prg(buf, global_size=(nblk, 1, 1), local_size=(1, 1, 1), vals=(iters,), wait=True)
        x = np.arange(nblk, dtype=np.uint64)
        for _ in range(iters): x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        assert np.array_equal(read(buf, np.uint32), x.astype(np.uint32))
    finally:
        dev.allocator.free(buf, nblk * 4, SPEC)


# ---------------------------------------------------------------- compile cache and CC
@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    assert toolchain.cache_dir() == tmp_path
    return tmp_path


def unique_kernel() -> tuple[str, str]:
    name = f"k_{uuid.uuid4().hex[:12]}"
    return f"HCQ_KERNEL void {name}(int *o, int v) {{ o[0] = v * 2; }}", name


def test_compile_cache(dev, fresh_cache, compiler_runs):
    src, name = unique_kernel()
    prg1 = dev.compile(src, name)
    assert len(compiler_runs) == 1
    assert len(list(fresh_cache.glob("hcq-kernel-*.lib"))) == 1
    assert not list(fresh_cache.glob("hcq-lib-*")), "an object loaded in-process needs no loadable copy"
    mtimes = {p: p.stat().st_mtime_ns for p in fresh_cache.iterdir()}
    prg2 = dev.compile(src, name)
    assert len(compiler_runs) == 1, "the second compile of the same source must come from the cache"
    assert {p: p.stat().st_mtime_ns for p in fresh_cache.iterdir()} == mtimes
    buf = alloc(dev, 8)
    try:
        for prg, v in ((prg1, 21), (prg2, 5)):
            prg(buf, vals=(v,), wait=True)
            assert read(buf, np.int32)[0] == 2 * v
    finally:
        dev.allocator.free(buf, 8, SPEC)
    # a different source is a different cache entry
    dev.compile(src + "\n/* changed */\n", name)
    assert len(compiler_runs) == 2
    assert len(list(fresh_cache.glob("hcq-kernel-*.lib"))) == 2


def test_compile_cache_survives_in_memory_reset(dev, fresh_cache, compiler_runs):
    """The cache is on disk: a new compiler object (as in a new process) reuses the built library."""
    from hcq.backends.cpu.compiler import CPUCompiler
    src, name = unique_kernel()
    lib1 = CPUCompiler().compile(src)
    lib2 = CPUCompiler().compile(src)
    assert lib1 == lib2 and len(compiler_runs) == 1


def test_compile_cache_key_includes_flags(dev, fresh_cache, compiler_runs, monkeypatch):
    from hcq.backends.cpu.compiler import CPUCompiler
    src, name = unique_kernel()
    CPUCompiler().compile(src)
    monkeypatch.setenv("HCQ_CPU_CFLAGS", "-DHCQ_TEST_FLAG=1")
    CPUCompiler().compile(src)
    assert len(compiler_runs) == 2
    assert len(list(fresh_cache.glob("hcq-kernel-*.lib"))) == 2


def test_cc_nonexistent_compiler(dev, fresh_cache, monkeypatch, clear_find_compiler):
    monkeypatch.setenv("CC", "hcq-no-such-cc-7f3a")
    src, name = unique_kernel()
    with pytest.raises(hcq.CompileError, match="hcq-no-such-cc-7f3a"):
        dev.compile(src, name)


def wrap_cc(monkeypatch, path, real_cc: str, before: str) -> None:
    """Make CC a shell script at `path` that runs the line `before`, then the real compiler."""
    path.write_text(f"#!/bin/sh\n{before}\nexec {real_cc} \"$@\"\n")
    path.chmod(0o755)
    monkeypatch.setenv("CC", str(path))
    toolchain.find_compiler.cache_clear()


def test_cc_selects_compiler(dev, fresh_cache, monkeypatch, clear_find_compiler, compiler_runs):
    src, name = unique_kernel()
    dev.compile(src, name)  # with the default compiler
    # a wrapper script as CC: proves CC is the compiler that runs
    marker, wrapper = fresh_cache / "cc-was-used", fresh_cache / "my-cc"
    wrap_cc(monkeypatch, wrapper, compiler_runs[-1][0], f"echo used >> {marker}")
    assert toolchain.find_compiler()[0] == str(wrapper)
    prg = dev.compile(src, name)  # same source, other compiler: a new cache entry
    assert compiler_runs[-1][0] == str(wrapper) and len(compiler_runs) == 2
    assert marker.exists()
    assert len(list(fresh_cache.glob("hcq-kernel-*.lib"))) == 2
    buf = alloc(dev, 8)
    try:
        prg(buf, vals=(4,), wait=True)
        assert read(buf, np.int32)[0] == 8
    finally:
        dev.allocator.free(buf, 8, SPEC)


def test_the_compiler_runs_in_its_own_group_within_the_callers_session(dev, fresh_cache, monkeypatch, clear_find_compiler):
    """Its own process group (a timeout kills the whole group), but this process's session: where Linux schedules by
    session (autogroup), a compiler in a new session would get as much CPU as this whole process."""
    import sys
    record = fresh_cache / "ids"
    wrap_cc(monkeypatch, fresh_cache / "cc-ids", toolchain.find_compiler()[0], f"cat /proc/$$/stat >> {record}")
    src, name = unique_kernel()
    dev.compile(src, name)
    last = record.read_text().split("\n")[-2]  # the last compile's (after the version probe)
    pid, (pgid, sid) = int(last.split()[0]), map(int, last.rsplit(")", 1)[1].split()[2:4])
    assert pgid == pid, "the compiler leads a process group of its own"
    if sys.version_info >= (3, 11): assert sid == os.getsid(0), "and stays in this session"


def test_cc_broken_compiler_reports_its_output(dev, fresh_cache, monkeypatch, clear_find_compiler):
    wrapper = fresh_cache / "bad-cc"
    wrapper.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo bad-cc 1.0; exit 0; fi\necho 'bad-cc: licence expired' >&2\nexit 3\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    src, name = unique_kernel()
    with pytest.raises(hcq.CompileError, match="licence expired"):
        dev.compile(src, name)


# ---------------------------------------------------------------- source directives
def test_freestanding_directive_builds_without_system_headers(dev, fresh_cache, compiler_runs):
    """`#pragma hcq freestanding`: no libc headers parsed (the built-ins still work), nothing linked."""
    name = f"k_{uuid.uuid4().hex[:12]}"
    src = f"#pragma hcq freestanding\nHCQ_KERNEL void {name}(int *o, int v) {{ o[hcq_global_id(0)] = v + (int)hcq_global_id(0); }}"
    prg = dev.compile(src, name)
    build = compiler_runs[-1]  # an object for hcq's loader: nothing is linked
    assert "-c" in build and "-nostdlib" in build and "-lm" not in build, build
    meta = json.loads(next(fresh_cache.glob("hcq-kernel-*.lib.meta")).read_text())
    assert meta["deps"] == {}, "no header was read"
    buf = alloc(dev, 16)
    try:
        prg(buf, global_size=4, vals=(10,), wait=True)
        assert list(read(buf, np.int32)) == [10, 11, 12, 13]
    finally:
        dev.allocator.free(buf, 16, SPEC)
    with pytest.raises(hcq.CompileError, match="error"):  # and <math.h> really is gone
        dev.compile(f"#pragma hcq freestanding\nHCQ_KERNEL void {name}(float *o) {{ o[0] = sinf(o[0]); }}", name)


def test_native_directive_keys_the_cache_by_host_cpu(dev, fresh_cache, compiler_runs):
    src, name = unique_kernel()
    dev.compile("#pragma hcq native\n" + src, name)
    assert "-march=native" in compiler_runs[-1] and toolchain.host_key(tuple(compiler_runs[-1])) == (f"host-cpu={toolchain.host_cpu_tag()}",)


def test_kernels_are_built_for_this_cpu_unless_portable(dev, fresh_cache, compiler_runs, monkeypatch):
    """-march=native by default (the host CPU keys the cache); `#pragma hcq portable` or HCQ_CPU_NATIVE=0 builds for any
    CPU of the architecture (a cache shared across machines), and the two builds are separate cache entries."""
    from hcq.backends.cpu.compiler import CPUCompiler
    src, name = unique_kernel()
    dev.compile(src, name)
    assert "-march=native" in compiler_runs[-1] and toolchain.host_key(tuple(compiler_runs[-1]))
    dev.compile("#pragma hcq portable\n" + src, name)
    assert len(compiler_runs) == 2 and "-march=native" not in compiler_runs[-1]
    monkeypatch.setenv("HCQ_CPU_NATIVE", "0")
    portable = CPUCompiler()
    assert "-march=native" not in portable.flags and "-march=native" in portable.flags_for(frozenset({"native"}))
    monkeypatch.setenv("HCQ_CPU_NATIVE", "1")
    assert "-march=native" in CPUCompiler().flags


def test_unknown_directive_and_clang_requirement(dev, fresh_cache, monkeypatch, clear_find_compiler):
    src, name = unique_kernel()
    with pytest.raises(hcq.CompileError, match="unknown directive '#pragma hcq fast'; known: clang, freestanding, native, plain-entry, portable"):
        dev.compile("#pragma hcq fast\n" + src, name)
    if toolchain.shutil.which("gcc") is None: return
    monkeypatch.setenv("CC", "gcc")
    with pytest.raises(hcq.CompileError, match="needs clang"):
        dev.compile("#pragma hcq clang\n" + src, name)


def test_plain_entry_directive_runs_every_block_and_thread(dev, fresh_cache):
    from hcq.backends.cpu.compiler import generate
    name = f"k_{uuid.uuid4().hex[:12]}"
    src = (f"#pragma hcq plain-entry\nstatic __attribute__((noinline)) void body(int *o, long i) {{ o[i] = (int)i; }}\n"
           f"HCQ_KERNEL void {name}(int *o) {{ body(o, hcq_global_id(0)); }}")
    full, _ = generate(src)
    assert ("optnone" in full) == ("clang" in toolchain.find_compiler()[1].lower())
    prg = dev.compile(src, name)
    buf = alloc(dev, 4 * 24)
    try:
        prg(buf, global_size=(6, 1, 1), local_size=(4, 1, 1), wait=True)
        assert list(read(buf, np.int32)) == list(range(24))
    finally:
        dev.allocator.free(buf, 4 * 24, SPEC)


def test_precompile_warms_the_cache_without_a_device(open_device, fresh_cache, compiler_runs):
    src, name = unique_kernel()
    hcq.registry.precompile("CPU", src)
    assert len(compiler_runs) == 1
    open_device().compile(src, name)  # (the device opens only now)
    assert len(compiler_runs) == 1


# ---------------------------------------------------------------- the grid speed-up benchmark's kernel
def load_bench():
    from hcq.bench import grid_speedup
    return grid_speedup


def test_grid_speedup_kernel_same_result_with_1_and_2_workers(open_device, monkeypatch):
    bench = load_bench()
    monkeypatch.delenv("HCQ_CPU_WORKERS", raising=False)
    names = [d.device for d in (open_device(), open_device())]
    for name in names: hcq.Device(name).close()  # (names no open device holds: the bench opens them anew)
    d1 = bench.open_device(names[0], 1)
    d2 = bench.open_device(names[1], 2)
    assert open_device(d1.device) is d1 and open_device(d2.device) is d2  # (so they are closed when the test ends)
    assert (d1.num_workers, d2.num_workers) == (1, 2)
    assert "HCQ_CPU_WORKERS" not in os.environ  # open_device restores the environment
    _, o1 = bench.run(d1, blocks=256, iters=2000)
    _, o2 = bench.run(d2, blocks=256, iters=2000)
    assert np.array_equal(o1, o2)
    # and the result is the right one (the same recurrence in numpy)
    x = 1.0 + np.arange(256) * 1e-3
    y = np.full(256, 0.5)
    for _ in range(2000):
        x = x * 0.9999997 + 1e-7
        y = y * 0.999999 + x * 1e-6
    np.testing.assert_allclose(o1, x + y, rtol=1e-12)


@pytest.mark.parametrize("source, expected", [
    ('a // x\nb', 'a     \nb'),
    ('a /* x\ny */ b', 'a     \n     b'),
    ('s = "// not /* a comment"; // c', 's = "// not /* a comment";     '),
    ("c = '\\''; /* q */", "c = '\\'';        "),
    ('"esc \\" // still a string" x', '"esc \\" // still a string" x'),
    ('"line ends\n// comment', '"line ends\n          '),
    ('/* unterminated\nto the end', '               \n          '),
    ('a */ b', 'a */ b'),
])
def test_comments_are_blanked_line_numbers_kept_literals_untouched(source, expected):
    from hcq.backends.cpu.compiler import strip_comments
    assert strip_comments(source) == expected
    assert strip_comments(source).count("\n") == source.count("\n")
