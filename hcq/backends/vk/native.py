"""Loading the Vulkan command processor (vk.c): built with the machine's C compiler against the Vulkan headers on
first use and cached on disk like cp.c; `unavailable_reason()` says why no VK device can open here."""
from __future__ import annotations

import ctypes
import functools
import shutil
from pathlib import Path

from hcq import packets
from hcq.errors import CompileError
from hcq.packet_queue import SubmitStatus
from hcq.toolchain import build_shared_object, inline_include

VK_SOURCE = Path(__file__).with_name("vk.c")
VK_FLAGS = ("-O2", "-std=c11", "-pthread", "-fvisibility=hidden", "-lvulkan")
CUR_PKT_WORDS = 4  # words of the running packet a ring reports (hang reports)
RING_STATE = ("rptr", "wptr", "packets_done", "position") + tuple(f"pkt{i}" for i in range(CUR_PKT_WORDS))
INFO = ("user_host_visible", "host_import", "import_align", "timestamp_period_bits", "timestamp_bits", "max_grid_x", "max_grid_y",
        "max_grid_z", "max_block_x", "max_block_y", "max_block_z", "max_block_threads", "vendor_id", "device_id", "api_version",
        "hardware_queues", "cpu_type", "storage_buffer_alignment", "max_storage_buffer_range")
APT_PACKAGES = "libvulkan1 libvulkan-dev mesa-vulkan-drivers glslang-tools"


def shared_header() -> str:
    """What vk.c shares with Python: the packet format, the submit statuses, the size of a ring's packet report."""
    return "\n".join([packets.c_header(), "enum { " + ", ".join(f"SUBMIT_{s.name} = {int(s)}" for s in SubmitStatus) + " };",
                      f"#define CUR_PKT_WORDS {CUR_PKT_WORDS}", ""])


def vk_source() -> str:
    """vk.c with its headers (the shared one, generated; the core's ring.h, as cp.c takes it) put in place of the lines
    that include them."""
    source = inline_include(VK_SOURCE.read_text(), "hcq_shared.h", shared_header(), "vk.c")
    return inline_include(source, "ring.h", packets.RING_HEADER.read_text(), "vk.c")


@functools.lru_cache(maxsize=None)
def engine() -> ctypes.CDLL:
    """The Vulkan command-processor library, with its function signatures declared."""
    lib = ctypes.CDLL(str(build_shared_object(vk_source(), VK_FLAGS, "hcq-vk")))
    vp, u64, i64, i32, cp = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
    sigs = {
        "hcq_vk_count": (i32, [cp, i32]),
        "hcq_vk_name": (i32, [i32, cp, i32]),
        "hcq_vk_open": (vp, [i32, i32, cp, i32]),
        "hcq_vk_info": (None, [vp, ctypes.POINTER(u64), cp, i32]),
        "hcq_vk_id": (ctypes.c_uint32, [vp]),
        "hcq_vk_stop": (None, [vp]),
        "hcq_vk_close": (None, [vp]),
        "hcq_vk_error": (i32, [vp, cp, i32]),
        "hcq_vk_inject_device_lost": (None, [vp, i64]),
        "hcq_vk_alloc": (i32, [vp, u64, i32, ctypes.POINTER(u64), ctypes.POINTER(vp)]),
        "hcq_vk_import_host": (i32, [vp, vp, u64, ctypes.POINTER(u64)]),
        "hcq_vk_free": (None, [vp, u64]),
        "hcq_vk_program": (u64, [vp, vp, u64, cp, vp, i32, ctypes.c_uint32, vp, ctypes.c_uint32, cp, i32]),
        "hcq_vk_ring_create": (i32, [vp, i32, i32, u64, ctypes.POINTER(vp)]),
        "hcq_vk_submit": (i32, [vp, vp, u64, i64]),
        "hcq_vk_rptr": (u64, [vp]),
        "hcq_vk_wptr": (u64, [vp]),
        "hcq_vk_ring_state": (None, [vp, ctypes.POINTER(u64)]),
        "hcq_vk_wait": (i32, [vp, u64, u64, i64]),
        "hcq_vk_set_store_hook": (None, [vp, vp]),
        "hcq_vk_signal_store": (None, [vp, vp, u64, u64]),
        "hcq_vk_name_feeder": (ctypes.c_uint32, [cp]),
        "hcq_vk_address_of_host": (u64, [vp, u64, u64]),
        "hcq_vk_failed_flag": (vp, [vp]),
        "hcq_vk_wait_idle": (i32, [vp, i64]),
        "hcq_vk_signal_poison": (None, [vp, u64, ctypes.c_uint32]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def function_address(name: str) -> int:
    """The C address of vk.c's function `name` (for callers in C: hcq.interfaces.HostStores)."""
    return ctypes.cast(getattr(engine(), name), ctypes.c_void_p).value  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """Why no VK device can be opened on this machine (no glslang, no Vulkan headers or loader, no driver), or None."""
    fix = f"(apt-get install {APT_PACKAGES})"
    if shutil.which("glslangValidator") is None: return f"glslangValidator (the GLSL to SPIR-V compiler) is not installed {fix}"
    try:
        lib = engine()
    except CompileError as e:
        first = str(e).splitlines()[1] if len(str(e).splitlines()) > 1 else str(e)
        return f"the Vulkan command processor does not build here ({first.strip()}) {fix}"
    except OSError as e:
        return f"the Vulkan loader cannot be loaded ({e}) {fix}"
    err = ctypes.create_string_buffer(512)
    n = lib.hcq_vk_count(err, len(err))
    return None if n > 0 else f"{err.value.decode(errors='replace')} {fix}"
