"""The NV backend's compiler (hcq's C dialect or PTX -> sm_90 cubin, with NVRTC) and its cubin reader, checked
against real cubins: parameter layout (against C's own struct layout, and the CPU compiler's), constant bank 0,
shared memory, registers, stack, launch bounds, the loaded image and its relocations; malformed cubins; compile
errors; the cache. Tests that need NVRTC skip, saying why, where it is not installed (pip install nvidia-cuda-nvrtc)."""
import ctypes
import random
import struct

import pytest

from hcq import toolchain
from hcq.backends.nv import compiler as nvc
from hcq.backends.nv.compiler import NVCompiler, source_of
from hcq.backends.nv.cubin import IMAGE_ALIGN, R_CUDA_64, R_CUDA_ABS32_HI_32, R_CUDA_ABS32_LO_32, CubinParam, read_cubin
from hcq.errors import CompileError

NVRTC_MISSING = NVCompiler.unavailable_reason()
needs_nvrtc = pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"no NVRTC here: {NVRTC_MISSING}")
SM90_PARAM_BASE = 0x210  # Hopper's driver area in constant bank 0 comes before the parameters
BASE = 0x7F12_3400_0000


@pytest.fixture
def nv_cache(tmp_path, monkeypatch):
    """A fresh, empty compile cache."""
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    assert toolchain.cache_dir() == tmp_path
    return tmp_path


@pytest.fixture(scope="module")
def nv_compiler():
    return NVCompiler()


def raw_sections(data: bytes) -> dict[str, tuple[int, int, int, int]]:
    """{name: (type, file offset, size, sh_info)} of an ELF64's sections, read here independently of the reader."""
    shoff, = struct.unpack_from("<Q", data, 40)
    shnum, shstrndx = struct.unpack_from("<HH", data, 60)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + 64 * i) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    name = lambda off: data[strtab + off:data.index(b"\0", strtab + off)].decode()  # noqa: E731
    return {name(h[0]): (h[1], h[4], h[5], h[7]) for h in headers}


def c_layout(*ctypes_fields) -> list[tuple[int, int]]:
    """(offset, size) of each field of a C struct of these types: how parameters are laid out."""
    S = type("S", (ctypes.Structure,), {"_fields_": [(f"f{i}", t) for i, t in enumerate(ctypes_fields)]})
    return [(getattr(S, f"f{i}").offset, ctypes.sizeof(t)) for i, t in enumerate(ctypes_fields)]


MIXED = ("HCQ_KERNEL void mixed(uint8_t a, uint64_t b, uint16_t c, uint32_t *p, int8_t d, double e, const float *q, int32_t f, uint16_t g) {\n"
         "  p[hcq_global_id(0)] = (uint32_t)(a + b + c + d + e + q[0] + f + g);\n"
         "}\n")
MIXED_TYPES = (ctypes.c_uint8, ctypes.c_uint64, ctypes.c_uint16, ctypes.c_void_p, ctypes.c_int8, ctypes.c_double, ctypes.c_void_p,
               ctypes.c_int32, ctypes.c_uint16)


@needs_nvrtc
def test_parameters_sit_in_constant_bank_0_as_a_c_struct_would(nv_compiler):
    cubin = read_cubin(nv_compiler.compile(MIXED))
    assert cubin.arch == 90
    k = cubin.kernels["mixed"]
    assert [(p.offset, p.size) for p in k.params] == c_layout(*MIXED_TYPES)  # (alignment padding after a, c, d and f)
    assert [p.ordinal for p in k.params] == list(range(9))
    assert k.param_base == SM90_PARAM_BASE
    last = k.params[-1]
    assert k.param_size >= last.offset + last.size
    assert k.cbank0_size == k.param_base + k.param_size
    assert k.shared_bytes == 0 and k.local_bytes == 0 and k.max_threads is None
    assert 0 < k.registers <= 255


@needs_nvrtc
def test_the_cpu_twin_lays_parameters_out_as_the_cubin_does(nv_compiler):
    """The emulated GPU reads each parameter at the cubin's offset and hands it to the CPU twin at the twin's own."""
    from hcq.backends.cpu.compiler import CPUCompiler, load_library
    slots, _, _ = load_library(CPUCompiler().compile(MIXED)).kernels["mixed"]
    k = read_cubin(nv_compiler.compile(MIXED)).kernels["mixed"]
    assert [s.offset for s in slots] == [p.offset for p in k.params]
    assert [s.is_pointer for s in slots] == [t is ctypes.c_void_p for t in MIXED_TYPES]


@needs_nvrtc
def test_no_parameters_and_many_parameters(nv_compiler):
    k = read_cubin(nv_compiler.compile("HCQ_KERNEL void none(void) { }\n")).kernels["none"]
    assert k.params == () and k.param_size == 0 and k.cbank0_size == k.param_base
    names = [f"a{i}" for i in range(60)]
    src = f"HCQ_KERNEL void many({', '.join(f'int32_t {n}' for n in names)}, int64_t *out) {{\n  out[0] = {' + '.join(names)};\n}}\n"
    k = read_cubin(nv_compiler.compile(src)).kernels["many"]
    assert k.params == tuple(CubinParam(i, 4 * i, 4) for i in range(60)) + (CubinParam(60, 240, 8),)
    assert k.param_base == SM90_PARAM_BASE and k.cbank0_size == SM90_PARAM_BASE + 248


@needs_nvrtc
def test_static_shared_memory_stack_and_launch_bounds(nv_compiler):
    src = ("HCQ_KERNEL void tiles(float *o) {\n"
           "  __shared__ float a[256]; __shared__ double b[3];\n"
           "  int64_t i = hcq_local_id(0);\n"
           "  a[i] = o[i]; if (i < 3) b[i] = o[i + 1]; __syncthreads();\n"
           "  o[i] = a[255 - i] + (float)b[i % 3];\n"
           "}\n"
           "HCQ_KERNEL void stack(int32_t *o, int32_t n) {\n"
           "  int32_t local[100];\n"
           "  for (int j = 0; j < 100; j++) local[j] = o[j] * n;\n"
           "  o[hcq_local_id(0)] = local[(hcq_local_id(0) * n) % 100];\n"
           "}\n"
           # (the dialect's kernel line has no room for launch bounds: a plain CUDA kernel beside the others)
           'extern "C" __global__ void __launch_bounds__(128) bounded(int32_t *o) { o[hcq_local_id(0)] = 1; }\n')
    ks = read_cubin(nv_compiler.compile(src + "HCQ_KERNEL void one(float *o) { __shared__ float a[256]; a[hcq_local_id(0)] = o[0]; "
                                     "__syncthreads(); o[1] = a[255 - hcq_local_id(0)]; }\n")).kernels
    # (the section the compiler gives a kernel's __shared__ variables starts with the 1 KiB sm_80+ reserve per block)
    assert ks["tiles"].shared_bytes == 1024 + 256 * 4 + 3 * 8 and ks["one"].shared_bytes == 1024 + 256 * 4
    assert ks["stack"].shared_bytes == 0 and ks["stack"].local_bytes >= 400
    assert ks["tiles"].local_bytes == 0
    assert ks["bounded"].max_threads == 128 and ks["tiles"].max_threads is None


def register_hungry(name: str, bounds: str = "") -> str:
    """A kernel that keeps 96 float accumulators live across a loop (with `bounds`: a plain CUDA kernel so bounded)."""
    n = 96
    head = f'extern "C" __global__ void {bounds}{name}' if bounds else f"HCQ_KERNEL void {name}"
    return (f"{head}(const float *x, float *o, int32_t steps) {{\n"
            f"  float {', '.join(f'r{i} = x[{i}]' for i in range(n))};\n"
            "  for (int32_t s = 0; s < steps; s++) {\n"
            "    float v = x[s + 128];\n"
            + "".join(f"    r{i} = r{i} * v + r{(i + 1) % n};\n" for i in range(n)) +
            "  }\n"
            + "".join(f"  o[{i}] = r{i};\n" for i in range(n)) +
            "}\n")


@needs_nvrtc
def test_register_counts(nv_compiler):
    ks = read_cubin(nv_compiler.compile(register_hungry("wide") + register_hungry("capped", "__launch_bounds__(1024) ")
                               + "HCQ_KERNEL void tiny(int32_t *o) { o[0] = 1; }\n")).kernels
    assert ks["wide"].registers > 96  # (each accumulator lives in a register of its own)
    assert ks["capped"].registers <= 64 and ks["capped"].max_threads == 1024  # (1024 threads x 64 = the 64K register file)
    assert ks["tiny"].registers < 32


@needs_nvrtc
def test_dimension_chosen_at_run_time_and_the_cpu_dialect_atomics_compile(nv_compiler):
    src = ("#pragma hcq freestanding\n"
           "HCQ_KERNEL void dims(int64_t *o, int32_t d, uint32_t *c, volatile uint64_t *f, float *h, _Bool b, size_t n, intptr_t ip) {\n"
           "  o[0] = hcq_local_id(d) + hcq_group_id(d) + hcq_local_size(d) + hcq_num_groups(d) + hcq_global_id(d);\n"
           "  uint32_t old = __atomic_fetch_add(c, 1, __ATOMIC_SEQ_CST);\n"
           "  __atomic_fetch_add(o + 1, (int64_t)-1, __ATOMIC_RELAXED); __atomic_fetch_add(h, 1.5f, __ATOMIC_RELAXED);\n"
           "  uint64_t v = __atomic_load_n(f, __ATOMIC_ACQUIRE); __atomic_store_n(f, v + old, __ATOMIC_RELEASE);\n"
           "  uint32_t e = 0; __atomic_compare_exchange_n(c, &e, 5u, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);\n"
           "  if (b && n == 7 && ip) __builtin_trap();\n"
           "}\n")
    assert [p.size for p in read_cubin(nv_compiler.compile(src)).kernels["dims"].params] == [8, 4, 8, 8, 8, 1, 8, 8]


@needs_nvrtc
def test_the_conformance_kernels_build_for_both_backends(nv_compiler):
    from hcq.backends.cpu.compiler import CPUCompiler, load_library
    from hcq.backends.nv.kernels import CONFORMANCE_KERNELS
    for source, name in CONFORMANCE_KERNELS.values():
        assert name in read_cubin(nv_compiler.compile(source)).kernels
        assert name in load_library(CPUCompiler().compile(source)).kernels


# ---------------------------------------------------------------- the loaded image and its relocations
GLOBALS = ("__device__ uint32_t ga[4];\n__device__ uint64_t gb[2];\n"
           "HCQ_KERNEL void g(uint32_t *o, int32_t i) { ga[i & 3] += o[0]; gb[i & 1] += o[1]; o[2] = ga[0] + (uint32_t)gb[0]; }\n"
           "HCQ_KERNEL void h(uint32_t *o) { o[0] = ga[1]; }\n")


@needs_nvrtc
def test_image_lays_out_code_and_constant_banks(nv_compiler):
    data = nv_compiler.compile(GLOBALS)
    cubin, raw = read_cubin(data), raw_sections(data)
    image = cubin.image(BASE)
    assert set(image.text) == {"g", "h"}
    for name, (offset, size) in image.text.items():
        _, file_offset, file_size, _ = raw[f".text.{name}"]
        assert offset % 128 == 0 and size == file_size
        assert image.data[offset:offset + size] == data[file_offset:file_offset + size]
    assert {("g", 0), ("h", 0), (None, 4)} <= set(image.constants)
    for (kernel, bank), (offset, size) in image.constants.items():
        assert offset % 256 == 0 and offset + size <= len(image.data)
        if kernel is not None and bank == 0: assert size == cubin.kernels[kernel].cbank0_size
    with pytest.raises(ValueError, match="multiple of"): cubin.image(BASE + 0x80)


def global_addresses(cubin, base: int) -> list[int]:
    image = cubin.image(base)
    offset, size = image.constants[(None, 4)]
    return list(struct.unpack_from(f"<{size // 8}Q", image.data, offset))


@needs_nvrtc
def test_r_cuda_64_relocations_point_into_the_image(nv_compiler):
    cubin = read_cubin(nv_compiler.compile(GLOBALS))
    image = cubin.image(BASE)
    addresses = global_addresses(cubin, BASE)  # (ga, gb, and whatever variables NVRTC's own headers add)
    assert len(addresses) >= 2 and len(set(addresses)) == len(addresses)
    used = [range(BASE + o, BASE + o + s) for o, s in [*image.text.values(), *image.constants.values()]]
    for a in addresses:
        assert BASE <= a < BASE + len(image.data)
        assert not any(a in r for r in used)  # (the variables get memory of their own: .nv.global, zero-filled)
        assert image.data[a - BASE] == 0
    assert global_addresses(cubin, BASE + 0x10000) == [a + 0x10000 for a in addresses]
    assert cubin.image(BASE).data == image.data


def patched_relocations(data: bytes, types: list[int]) -> bytes:
    """`data` with the first relocation entries into .nv.constant4 retyped to `types`, in order."""
    b = bytearray(data)
    _, offset, size, _ = raw_sections(data)[".rela.nv.constant4"]
    assert size >= 24 * len(types)
    for i, kind in enumerate(types):
        r_info, = struct.unpack_from("<Q", b, offset + 24 * i + 8)
        struct.pack_into("<Q", b, offset + 24 * i + 8, (r_info & ~0xFFFFFFFF) | kind)
    return bytes(b)


@needs_nvrtc
def test_abs32_lo_and_hi_relocations_and_unknown_ones(nv_compiler):
    data = nv_compiler.compile(GLOBALS)
    full = global_addresses(read_cubin(data), BASE)  # (one 64-bit address per 8-byte slot of the bank)
    offsets = [struct.unpack_from("<Q", data, raw_sections(data)[".rela.nv.constant4"][1] + 24 * i)[0] for i in range(2)]
    image = read_cubin(patched_relocations(data, [R_CUDA_ABS32_LO_32, R_CUDA_ABS32_HI_32])).image(BASE)
    bank, _ = image.constants[(None, 4)]
    words = [struct.unpack_from("<I", image.data, bank + off + 4)[0] for off in offsets]  # (into bits 63:32 of the word)
    assert words == [full[offsets[0] // 8] & 0xFFFFFFFF, full[offsets[1] // 8] >> 32]
    assert read_cubin(patched_relocations(data, [R_CUDA_64, R_CUDA_64])).image(BASE).data == read_cubin(data).image(BASE).data
    with pytest.raises(CompileError, match="unsupported relocation type 0x99 in .rela.nv.constant4"):
        read_cubin(patched_relocations(data, [R_CUDA_64, 0x99]))


# ---------------------------------------------------------------- malformed cubins
def elf_header(ei_class: int = 2, machine: int = 190) -> bytes:
    return b"\x7fELF" + bytes([ei_class, 1, 1, 0x41, 8]) + bytes(7) + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, 0, 0, 0, 0x5A04, 64, 56, 0, 64, 0, 0)


@pytest.mark.parametrize("data, message", [
    (b"", "not an ELF"), (b"MZ\x90\x00" + bytes(100), "not an ELF"), (b"\x7fELF\x02\x01", "truncated"),
    (elf_header(ei_class=1), "ELFCLASS64"), (elf_header(machine=62), "EM_CUDA"), (elf_header(), "section table"),
])
def test_malformed_headers(data, message):
    with pytest.raises(CompileError, match=message): read_cubin(data)


@needs_nvrtc
def test_malformed_cubins_raise_compile_error_only(nv_compiler):
    data = nv_compiler.compile(MIXED + GLOBALS)
    for cut in (40, 64, len(data) // 3, len(data) // 2, len(data) - 1):
        with pytest.raises(CompileError): read_cubin(data[:cut])
    b = bytearray(data)
    _, info, _, _ = raw_sections(data)[".nv.info.mixed"]
    struct.pack_into("<H", b, info + 2, 0xFFFF)  # (the first record's payload size, past the section)
    with pytest.raises(CompileError, match="truncated"): read_cubin(bytes(b))
    rng = random.Random(90)
    for _ in range(400):
        b = bytearray(data)
        for _ in range(rng.randint(1, 6)): b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            read_cubin(bytes(b))  # (which lays the image out and relocates it once, to refuse what cannot load)
        except CompileError:
            pass


# ---------------------------------------------------------------- compiling: errors, cache, sources, PTX
@needs_nvrtc
def test_compile_errors_carry_the_log_at_the_users_lines(nv_compiler):
    with pytest.raises(CompileError) as e:
        nv_compiler.compile("#pragma hcq portable\nHCQ_KERNEL void bad(int32_t *o) {\n  o[0] = 1;\n  o[1] = not_declared;\n}\n")
    assert 'kernel.cu(4): error: identifier "not_declared" is undefined' in str(e.value)
    assert "hcq-nv-prelude" not in str(e.value)
    with pytest.raises(CompileError, match="no kernel found"): nv_compiler.compile("__device__ int x;\n")
    with pytest.raises(CompileError, match="unknown directive"): nv_compiler.compile("#pragma hcq sideways\nHCQ_KERNEL void k(void) {}\n")
    with pytest.raises(CompileError, match="unsupported type"): nv_compiler.compile("HCQ_KERNEL void k(struct s v) {}\n")


@needs_nvrtc
def test_cubins_are_cached_and_remember_their_source(nv_cache, monkeypatch):
    lib = nvc.nvrtc()
    runs = []
    real = lib.compile
    monkeypatch.setattr(lib, "compile", lambda *a: runs.append(a) or real(*a))
    src = "HCQ_KERNEL void cached(int32_t *o) { o[0] = 42; }\n"
    first = NVCompiler().compile(src)
    assert len(runs) == 1 and list(nv_cache.glob("hcq-nv-*.cubin"))
    nvc._sources.clear()  # (as in a new process: only the disk cache is left)
    assert NVCompiler().compile(src) == first and len(runs) == 1
    assert source_of(first) == src and NVCompiler.source_of(first) == src
    assert source_of(b"not a cubin this process made") is None
    NVCompiler().compile(src + "\n")
    assert len(runs) == 2


def test_without_nvrtc_compiling_says_what_to_install(monkeypatch):
    monkeypatch.setattr(nvc, "nvrtc", lambda: "NVRTC was not found; pip install nvidia-cuda-nvrtc")
    assert "nvidia-cuda-nvrtc" in (NVCompiler.unavailable_reason() or "")
    with pytest.raises(CompileError, match="nvidia-cuda-nvrtc"): NVCompiler().compile("HCQ_KERNEL void k(void) {}\n")
    with pytest.raises(CompileError, match="sm_NN"): NVCompiler("compute_90")


PTX = """//
// a hand-written kernel
.version 8.0
.target sm_90
.address_size 64

.visible .entry rq(.param .u64 o, .param .u32 v)
.reqntid 64, 2, 1
{
  .reg .b64 %rd<3>;
  .reg .b32 %r<2>;
  ld.param.u64 %rd1, [o];
  ld.param.u32 %r1, [v];
  cvta.to.global.u64 %rd2, %rd1;
  st.global.u32 [%rd2], %r1;
  ret;
}
"""


def ptx_tool() -> str | None:
    import shutil
    return None if isinstance(nvc.nvjitlink(), str) and shutil.which("ptxas") is None else "found"


@pytest.mark.skipif(ptx_tool() is None, reason="no PTX assembler here (pip install nvidia-nvjitlink, or ptxas on PATH)")
def test_ptx_input(nv_cache):
    assert nvc.is_ptx(PTX) and not nvc.is_ptx(MIXED) and not nvc.is_ptx("// .target x\nHCQ_KERNEL void k(void) {}\n")
    data = NVCompiler().compile(PTX)
    k = read_cubin(data).kernels["rq"]
    assert k.max_threads == 128  # (.reqntid 64, 2, 1)
    assert [(p.offset, p.size) for p in k.params] == [(0, 8), (8, 4)] and k.param_base == SM90_PARAM_BASE
    assert source_of(data) == PTX
    with pytest.raises(CompileError, match="bogus"): NVCompiler().compile(PTX.replace("st.global", "st.bogus"))


# ---------------------------------------------------------------- the dialect's parsing, shared with the CPU compiler
def test_the_cpu_compiler_still_compiles_after_the_parsing_moved():
    import hcq.kernel_source as ks
    from hcq.backends.cpu import compiler as cpu
    for name in ("KernelParam", "parse_params", "strip_comments", "directives", "DIRECTIVES", "SCALAR_FORMATS"):
        assert getattr(cpu, name) is getattr(ks, name)
    assert cpu.KERNEL_RE is ks.KERNEL_RE
    src = "// c\n#pragma hcq portable\nHCQ_KERNEL void twice(uint32_t *o, uint16_t k) { o[hcq_global_id(0)] = 2u * k; }\n"
    slots, size, entry = cpu.load_library(cpu.CPUCompiler().compile(src)).kernels["twice"]
    assert [(s.name, s.is_pointer, s.offset) for s in slots] == [("o", True, 0), ("k", False, 8)] and entry
    assert ks.find_kernels(ks.without_directives(src)) == {"twice": ks.parse_params("twice", "uint32_t *o, uint16_t k")}
