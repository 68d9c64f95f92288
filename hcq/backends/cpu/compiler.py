"""The CPU device's kernel compiler. Kernels are C: `HCQ_KERNEL void name(params)` marks an entry point.
For each entry a trampoline is generated that unpacks the kernargs block (laid out as a C struct of the
parameters) and runs the body once per (block, thread) of the blocks it is handed. The struct's offsets
are read back from the compiled library, so Python and C can never disagree on the layout.

A source may start with `#pragma hcq ...` directives (see DIRECTIVES): generated code that needs no C library
says `freestanding` and skips parsing the system headers, which is most of a small kernel's compile time."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Callable

from hcq.backends.cpu import loader
from hcq.backends.cpu.native import engine
from hcq.toolchain import build_library, build_shared_object, cache_dir, find_compiler, read_trusted, store
from hcq.errors import CompileError
from hcq.helpers import env_flag, getenv
# The dialect's parsing lives in hcq.kernel_source (the NV backend reads the same sources); its public names stay importable here.
from hcq.kernel_source import (DIRECTIVES, KERNEL_RE, SCALAR_FORMATS, KernelParam, directives, find_kernels, parse_params,  # noqa: F401
                               strip_comments, without_directives)
from hcq.program import ArgSlot

HOSTED_HEADERS = """#include <stdint.h>
#include <stddef.h>
#include <stdbool.h>
#include <math.h>
"""
# What the prelude and the trampolines need from <stdint.h>/<stddef.h>, from the compiler's own macros.
FREESTANDING_HEADERS = """typedef __INT64_TYPE__ int64_t;
typedef __UINT64_TYPE__ uint64_t;
#define offsetof(t, m) __builtin_offsetof(t, m)
"""
PRELUDE = r"""typedef struct { uint64_t ngrp[3], lsz[3]; } hcq_launch_t;
typedef struct { int64_t grp[3], lid[3], lsz[3], ngrp[3]; } hcq_ctx_t;
/* What the entry point keeps up to date in the running thread's slots (cp.c's hcq_entry_slots_t), and the host's
   function that reads the launch context back (cp.c's hcq_launch_ctx), filled in when the library is loaded: the
   code keeps no thread-locals, so it loads without a dynamic linker. */
typedef struct { volatile uint64_t block; const void *volatile launch_ctx; } hcq_entry_slots_t;
typedef struct { const void *(*get)(void); } hcq_host_t;
__attribute__((visibility("default"))) hcq_host_t __hcq_host;
/* Kernel bodies get the context as a parameter named __hcq_ctx, which keeps the built-ins in registers; elsewhere
   (helper functions) __hcq_ctx is this function, which asks the host. The macros take whichever is in scope. */
static inline __attribute__((pure)) const hcq_ctx_t *__hcq_ctx(void) { return (const hcq_ctx_t *)__hcq_host.get(); }
static inline const hcq_ctx_t *__hcq_ctx_pass(const hcq_ctx_t *c) { return c; }
static inline const hcq_ctx_t *__hcq_ctx_call(const hcq_ctx_t *(*f)(void)) { return f(); }
#define __hcq_ctx_of(x) _Generic((x), const hcq_ctx_t *: __hcq_ctx_pass, default: __hcq_ctx_call)(x)
#define HCQ_KERNEL static inline __attribute__((always_inline))
#define hcq_local_id(d) (__hcq_ctx_of(__hcq_ctx)->lid[(d)])
#define hcq_group_id(d) (__hcq_ctx_of(__hcq_ctx)->grp[(d)])
#define hcq_local_size(d) (__hcq_ctx_of(__hcq_ctx)->lsz[(d)])
#define hcq_num_groups(d) (__hcq_ctx_of(__hcq_ctx)->ngrp[(d)])
#define hcq_global_id(d) (hcq_group_id(d) * hcq_local_size(d) + hcq_local_id(d))
#line 1 "kernel.c"
"""

ENTRY = r"""
struct __hcq_args_{name} {{ {members} }};
__attribute__((visibility("default"){entry_attrs})) void __hcq_entry_{name}(const void *kargs, const hcq_launch_t *L, uint64_t b0, uint64_t b1,
                                                              hcq_entry_slots_t *slots) {{
  const struct __hcq_args_{name} *a = (const struct __hcq_args_{name} *)kargs; (void)a;
  hcq_ctx_t c;
  for (int d = 0; d < 3; d++) {{ c.lsz[d] = (int64_t)L->lsz[d]; c.ngrp[d] = (int64_t)L->ngrp[d]; }}
  slots->launch_ctx = &c;
  const uint64_t gx = L->ngrp[0], gxy = L->ngrp[0] * L->ngrp[1];
  for (uint64_t b = b0; b < b1; b++) {{
    slots->block = b;  /* names the block if it faults */
    c.grp[0] = (int64_t)(b % gx); c.grp[1] = (int64_t)((b % gxy) / gx); c.grp[2] = (int64_t)(b / gxy);
    for (int64_t z = 0; z < c.lsz[2]; z++) for (int64_t y = 0; y < c.lsz[1]; y++) for (int64_t x = 0; x < c.lsz[0]; x++) {{
      c.lid[0] = x; c.lid[1] = y; c.lid[2] = z;
      {name}(&c{call_args});
    }}
  }}
  slots->launch_ctx = 0;
}}
__attribute__((visibility("default"))) const uint64_t __hcq_layout_{name}[] = {{ sizeof(struct __hcq_args_{name}){offsets} }};
"""


def generate(source: str, wanted: frozenset[str] | None = None) -> tuple[str, dict[str, list[KernelParam]]]:
    """The full translation unit for `source` (kernels gain the context parameter and a trampoline each);
    `wanted`: its directives, when the caller has already read them."""
    wanted = directives(source) if wanted is None else wanted
    headers = FREESTANDING_HEADERS if "freestanding" in wanted else HOSTED_HEADERS
    entry_attrs = ", noinline, optnone" if "plain-entry" in wanted and "clang" in find_compiler()[1].lower() else ""
    source = without_directives(source)  # blanked, not removed: line numbers still match
    kernels = find_kernels(source)

    def add_ctx(m: re.Match) -> str:
        rest = m.group(2).strip()
        return f"HCQ_KERNEL void {m.group(1)}(const hcq_ctx_t *__hcq_ctx{', ' + rest if rest not in ('', 'void') else ''}){m.group(3) or ''}"

    parts = [headers, PRELUDE, KERNEL_RE.sub(add_ctx, source), '\n#line 1 "hcq-generated-entry-points"\n']
    for name, params in kernels.items():
        members = " ".join(f"{p.decl};" for p in params) or "char __unused;"
        parts.append(ENTRY.format(name=name, entry_attrs=entry_attrs, members=members, call_args="".join(f", a->{p.name}" for p in params),
                                  offsets="".join(f", offsetof(struct __hcq_args_{name}, {p.name})" for p in params)))
    parts.append(signature_table(kernels))
    return "".join(parts), kernels


class CPUCompiler:
    """C source -> shared object bytes (cached on disk). Uses $CC, else clang, else cc; -O2 -march=native (the host CPU's
    model keys the cache; `#pragma hcq portable` or HCQ_CPU_NATIVE=0 leave -march out). Directives in the source
    (`#pragma hcq freestanding|clang|native|portable|plain-entry`) adjust the build."""

    BASE_FLAGS = ("-O2", "-std=gnu11", "-fno-math-errno", "-fvisibility=hidden", "-Werror=implicit-function-declaration")

    def __init__(self) -> None:
        self.extra = tuple(getenv("HCQ_CPU_CFLAGS", "").split())
        self.native = env_flag("HCQ_CPU_NATIVE", True)  # (FMA contraction and AVX2 where the CPU has them: 1.5-2x on FP chains)
        # shared objects for dlopen instead of objects for hcq's own loader: debuggers and profilers see those
        self.link = env_flag("HCQ_CPU_DLOPEN", False) or not loader.SUPPORTED
        self.flags = self.flags_for(frozenset(), cached=False)

    def flags_for(self, wanted: frozenset[str], cached: bool = True) -> tuple[str, ...]:
        """The compiler flags for a source with directives `wanted`."""
        if not wanted and cached: return self.flags
        flags = list(self.BASE_FLAGS)
        if "freestanding" in wanted: flags += ["-ffreestanding", "-nostdlib"]
        if "portable" not in wanted and (self.native or "native" in wanted):
            flags.append("-march=native")  # (toolchain.host_key then puts the host CPU into the cache key)
        return (*flags, *self.extra) + (() if "freestanding" in wanted else ("-lm",))

    def compile(self, source: str) -> bytes:
        wanted = directives(source)
        if "clang" in wanted and "clang" not in find_compiler()[1].lower():
            raise CompileError(f"this kernel source needs clang ('#pragma hcq clang'), but the C compiler is {find_compiler()[1]!r}; "
                               "install clang or set CC=clang")
        full, _ = generate(source, wanted)
        if self.link: return build_shared_object(full, self.flags_for(wanted), "hcq-kernel").read_bytes()
        return build_library(full, self.flags_for(wanted), "hcq-kernel", lambda obj: loader.refusal(obj) is None, f"hcq-loader-{loader.VERSION}")

    @staticmethod
    def version() -> str:
        return find_compiler()[1]


@dataclass
class LoadedLibrary:
    image: ctypes.CDLL | loader.LoadedObject  # keeps the code mapped
    kernels: dict[str, tuple[list[ArgSlot], int, int]]  # name -> (slots, kernargs size, entry address)


_loaded: dict[str, LoadedLibrary] = {}


def load_library(lib: bytes) -> LoadedLibrary:
    """Load a compiled kernel library (shared by every program and device that uses the same bytes): a relocatable
    object through hcq's loader, a shared object through dlopen."""
    digest = hashlib.sha256(lib).hexdigest()
    key = digest[:24]
    if key in _loaded: return _loaded[key]
    image: ctypes.CDLL | loader.LoadedObject
    if lib[16:18] == b"\x01\x00":  # e_type ET_REL
        image = loader.LoadedObject(lib)
    else:
        path = cache_dir() / f"hcq-lib-{key}.so"
        if read_trusted(path, digest) is None: store(path, lib, 0o700)  # the name is the content hash: verify it
        try:
            image = ctypes.CDLL(str(path))
        except OSError as e:  # (e.g. a symbol nobody defines)
            raise CompileError(f"cannot load the kernel library: {str(e).replace(str(path), 'hcq-lib-' + key + '.so')}") from e
    symbol: Callable[[str], int | None] = image.symbols.get if isinstance(image, loader.LoadedObject) else functools.partial(_dlsym, image)
    if (host := symbol("__hcq_host")) is None: raise CompileError("kernel library has no __hcq_host slot (was it built by this hcq's CPUCompiler?)")
    ctypes.memmove(host, ctypes.byref(_host_functions()), ctypes.sizeof(_HostFunctions))
    kernels = {}
    for name, params in _kernel_table(lib).items():
        entry, layout_at = symbol(f"__hcq_entry_{name}"), symbol(f"__hcq_layout_{name}")
        if entry is None or layout_at is None: raise CompileError(f"kernel library lacks the entry point or layout of {name!r}")
        layout = (ctypes.c_uint64 * (1 + len(params))).from_address(layout_at)
        slots = [ArgSlot(p.name, p.ctype, p.is_pointer, int(layout[1 + i]), p.fmt, read_only=p.is_pointer and "const" in p.decl.split("*")[0].split())
                 for i, p in enumerate(params)]
        kernels[name] = (slots, int(layout[0]), entry)
    _loaded[key] = LoadedLibrary(image, kernels)
    return _loaded[key]


def _dlsym(lib: ctypes.CDLL, name: str) -> int | None:
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:
        return None


class _HostFunctions(ctypes.Structure):
    _fields_ = [("get", ctypes.c_void_p)]  # the PRELUDE's hcq_host_t


@functools.cache
def _host_functions() -> _HostFunctions:
    lib = engine()
    return _HostFunctions(_dlsym(lib, "hcq_launch_ctx"))


def _kernel_table(lib: bytes) -> dict[str, list[KernelParam]]:
    # The library carries its own signature table so the bytes alone describe the kernels.
    start = lib.find(b"HCQSIG:")
    if start < 0: raise CompileError("library has no hcq kernel table (was it built by CPUCompiler?)")
    return _parse_table(lib[start + 7:lib.index(b"\0", start)].decode())


@functools.lru_cache(maxsize=64)  # (tinygrad's BEAM candidates all share one name and signature)
def _parse_table(table: str) -> dict[str, list[KernelParam]]:
    out = {}
    for entry in filter(None, table.split(";")):
        name, _, params = entry.partition("(")
        out[name] = parse_params(name, params.rstrip(")").replace("|", ","))
    return out


def signature_table(kernels: dict[str, list[KernelParam]]) -> str:
    body = ";".join(f"{n}({'|'.join(p.decl for p in ps)})" for n, ps in kernels.items())
    return f'\n__attribute__((visibility("default"), used)) const char __hcq_signatures[] = "HCQSIG:{body}";\n'
