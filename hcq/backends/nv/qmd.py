"""Launch descriptors (QMDs): a compute launch is a 256-byte structure in GPU memory whose fields the headers
define as bit ranges over the whole descriptor (`NVC6C0_QMDV03_00_CTA_RASTER_WIDTH = (415, 384)`). `Descriptor`
writes and reads them by name, for the QMD version the compute class takes (V03_00 for Ampere and Hopper)."""
from __future__ import annotations

from types import ModuleType
from typing import Callable

QMD_BYTES = 0x100
QMD_ALIGN = 0x100  # SEND_PCAS_A takes the address >> 8


def qmd_prefix(h: ModuleType, compute_class: int) -> str:
    """The header prefix of the QMD version `compute_class` takes."""
    if compute_class >= getattr(h, "BLACKWELL_COMPUTE_A", 1 << 32):
        raise NotImplementedError(f"compute class 0x{compute_class:x} takes QMD V05 (Blackwell), which hcq does not write yet")
    return "NVC6C0_QMDV03_00"


class Descriptor:
    """A QMD held as bytes: fields set and read by name (`set("cta_raster_width", 4)`); indexed fields take the index
    (`set("constant_buffer_valid", 1, index=0)`)."""

    def __init__(self, h: ModuleType, prefix: str, data: bytes | None = None):
        self.h, self.prefix = h, prefix
        self.data = bytearray(data if data is not None else bytes(QMD_BYTES))
        if len(self.data) != QMD_BYTES: raise ValueError(f"a QMD is {QMD_BYTES} bytes, got {len(self.data)}")

    def bits(self, name: str, index: int | None = None) -> tuple[int, int]:
        """The (high, low) bit range of field `name`."""
        rng: tuple[int, int] | Callable[[int], tuple[int, int]] = getattr(self.h, f"{self.prefix}_{name.upper()}")
        if callable(rng):
            if index is None: raise ValueError(f"QMD field {name} is indexed: give index=")
            rng = rng(index)
        elif index is not None:
            raise ValueError(f"QMD field {name} is not indexed")
        return rng

    def set(self, name: str, value: int, index: int | None = None) -> Descriptor:
        """Set a field (refusing a value that does not fit it)."""
        hi, lo = self.bits(name, index)
        width = hi - lo + 1
        if not 0 <= value < 1 << width: raise ValueError(f"QMD field {name} = {value:#x} does not fit its {width} bits")
        first, last = lo // 8, hi // 8 + 1
        word = int.from_bytes(self.data[first:last], "little")
        mask = ((1 << width) - 1) << (lo - first * 8)
        word = (word & ~mask) | (value << (lo - first * 8))
        self.data[first:last] = word.to_bytes(last - first, "little")
        return self

    def get(self, name: str, index: int | None = None) -> int:
        """A field's value."""
        hi, lo = self.bits(name, index)
        first, last = lo // 8, hi // 8 + 1
        return (int.from_bytes(self.data[first:last], "little") >> (lo - first * 8)) & ((1 << (hi - lo + 1)) - 1)

    def byte_offset(self, name: str, index: int | None = None) -> int:
        """The byte offset of a field that starts on a byte boundary (where a patched value is written)."""
        _, lo = self.bits(name, index)
        if lo % 8: raise ValueError(f"QMD field {name} does not start on a byte")
        return lo // 8

    def set_address(self, lower: str, upper: str, address: int, index: int | None = None) -> Descriptor:
        """Set an address split over a LOWER (32-bit) and an UPPER field."""
        return self.set(lower, address & 0xFFFFFFFF, index).set(upper, address >> 32, index)
