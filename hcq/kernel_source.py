"""Parsing of hcq's C kernel dialect, shared by the backends that compile it (CPU, NV): `HCQ_KERNEL void name(params)`
marks an entry point, its parameters are pointers or fixed-size scalars, and `#pragma hcq NAME` lines are directives.
Nothing here depends on a backend."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from hcq.errors import CompileError

SCALAR_FORMATS = {
    "char": "b", "signed char": "b", "unsigned char": "B", "short": "h", "unsigned short": "H", "int": "i", "signed": "i",
    "unsigned": "I", "unsigned int": "I", "long": "q", "unsigned long": "Q", "long long": "q", "unsigned long long": "Q",
    "int8_t": "b", "uint8_t": "B", "int16_t": "h", "uint16_t": "H", "int32_t": "i", "uint32_t": "I", "int64_t": "q",
    "uint64_t": "Q", "size_t": "Q", "ssize_t": "q", "ptrdiff_t": "q", "intptr_t": "q", "uintptr_t": "Q", "float": "f",
    "double": "d", "_Bool": "?", "bool": "?",
}
_QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "__restrict__"}
KERNEL_RE = re.compile(r"\bHCQ_KERNEL\s+void\s+([A-Za-z_]\w*)\s*\(([^)]*)\)(\s*\{)?")

DIRECTIVES = {
    "freestanding": "no C library: the system headers are not included and nothing is linked (-ffreestanding -nostdlib)",
    "clang": "the source needs clang (e.g. ext_vector_type); refuse to build with another compiler",
    "native": "tune for this machine (-march=native; the default unless HCQ_CPU_NATIVE=0); the cache key then includes the host's CPU model",
    "portable": "build for any CPU of this architecture (no -march=native), e.g. for a cache shared by different machines",
    "plain-entry": "with clang, build the generated entry points (the loops over blocks and threads) without optimization: "
                   "about a quarter less compile time for kernels whose work is in functions they call (generated code)",
}
DIRECTIVE_RE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+hcq[ \t]+(\S+)[ \t]*$", re.M)


@dataclass(frozen=True)
class KernelParam:
    decl: str  # the declaration as written, e.g. "const float *in"
    name: str
    ctype: str  # type without qualifiers, e.g. "float *" or "int"
    is_pointer: bool
    fmt: str


def parse_params(kernel: str, text: str) -> list[KernelParam]:
    """Parse a kernel's parameter list into typed parameters; unsupported types raise CompileError."""
    text = text.strip()
    if text in ("", "void"): return []
    params = []
    for raw in text.split(","):
        decl = " ".join(raw.split())
        m = re.fullmatch(r"(.*?)([A-Za-z_]\w*)", decl)
        if not m or not m.group(1).strip() or "[" in decl:
            raise CompileError(f"kernel {kernel}: cannot read parameter {decl!r}; write it as 'type name' (pointers as 'T *name')")
        type_part, name = m.group(1), m.group(2)
        is_pointer = "*" in type_part
        words = [w for w in type_part.replace("*", " * ").split() if w not in _QUALIFIERS]
        base = " ".join(w for w in words if w != "*")
        if is_pointer:
            params.append(KernelParam(decl, name, base + " *" * type_part.count("*"), True, "Q"))
            continue
        if base not in SCALAR_FORMATS:
            raise CompileError(f"kernel {kernel}: parameter {name!r} has unsupported type {base!r}; use a pointer or one of "
                               f"{', '.join(sorted(SCALAR_FORMATS))}")
        params.append(KernelParam(decl, name, base, False, SCALAR_FORMATS[base]))
    return params


# A string or character literal (to its closing quote, or the end of its line), a line comment, a block comment.
_LITERAL_OR_COMMENT_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"?|\'(?:[^\'\\\n]|\\.)*\'?|//[^\n]*|/\*.*?(?:\*/|\Z)', re.S)
_NOT_NEWLINE_RE = re.compile(r"[^\n]")


def _blank_comment(m: re.Match) -> str:
    text = m.group(0)
    return _NOT_NEWLINE_RE.sub(" ", text) if text[0] == "/" else text


@functools.lru_cache(maxsize=8)  # (a compile reads the directives, then generates from the same source)
def strip_comments(source: str) -> str:
    """`source` with C comments blanked out (newlines kept, so line numbers still match); string and
    character literals are left alone."""
    return _LITERAL_OR_COMMENT_RE.sub(_blank_comment, source)


def directives(source: str) -> frozenset[str]:
    """The `#pragma hcq NAME` directives of `source`; an unknown one raises CompileError."""
    found = frozenset(DIRECTIVE_RE.findall(strip_comments(source)))
    if unknown := found - DIRECTIVES.keys():
        raise CompileError(f"unknown directive '#pragma hcq {sorted(unknown)[0]}'; known: {', '.join(sorted(DIRECTIVES))}")
    return found


def without_directives(source: str) -> str:
    """`source` with its comments and `#pragma hcq` lines blanked (line numbers still match)."""
    return DIRECTIVE_RE.sub("", strip_comments(source))


def find_kernels(source: str) -> dict[str, list[KernelParam]]:
    """The kernels `source` defines (name -> parameters), in order; prototypes are skipped. CompileError for a kernel
    defined twice or a source with none. Pass the source with comments blanked (without_directives)."""
    kernels: dict[str, list[KernelParam]] = {}
    for m in KERNEL_RE.finditer(source):
        if m.group(3) is None: continue  # a prototype: the definition names the kernel
        if m.group(1) in kernels: raise CompileError(f"kernel {m.group(1)!r} is defined twice")
        kernels[m.group(1)] = parse_params(m.group(1), m.group(2))
    if not kernels: raise CompileError("no kernel found: mark an entry point with 'HCQ_KERNEL void name(...) { ... }'")
    return kernels


# The kernels the conformance kit names by behaviour (hcq.conformance), in this dialect: the CPU device takes them as
# they are (and adds one that faults), the NV device compiles them as CUDA C (and runs them as CPU twins when emulated).
CONFORMANCE_KERNELS: dict[str, tuple[str, str]] = {
    "fill": ("HCQ_KERNEL void fill(uint32_t *out, uint32_t value, uint32_t n) {\n"
             "  int64_t i = hcq_global_id(0);\n"
             "  if (i < (int64_t)n) out[i] = value;\n"
             "}\n", "fill"),
    "add": ("HCQ_KERNEL void add(uint32_t *out, const uint32_t *a, const uint32_t *b, uint32_t n) {\n"
            "  int64_t i = hcq_global_id(0);\n"
            "  if (i < (int64_t)n) out[i] = a[i] + b[i];\n"
            "}\n", "add"),
    # (the flag is read with acquire loads until the host sets it: a plain load could be hoisted out of the loop)
    "spin": ("HCQ_KERNEL void spin(uint64_t *flag, uint32_t *out) {\n"
             "  if (hcq_global_id(0) != 0) return;\n"
             "  while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0) {}\n"
             "  out[0] = 1;\n"
             "}\n", "spin"),
}
