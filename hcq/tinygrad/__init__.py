"""hcq as a tinygrad device.

`import hcq.tinygrad` registers the tinygrad device `HCQ`: `HCQ` (= `HCQ:0`) is hcq's `CPU:0`, `HCQ:n` is `CPU:n`,
or whatever `HCQ_TINYGRAD_DEVICES` names (a comma-separated list of hcq device names, the n-th for `HCQ:n`).
Select it with `DEV=HCQ` or `Tensor(..., device="HCQ")`. For tinygrad's own test suite, load this module as a
pytest plugin: `DEV=HCQ pytest -p hcq.tinygrad ...`.

tinygrad's C kernels are compiled by hcq (core_id becomes the block index of hcq's grid, so kernels use every
worker), buffers are hcq allocations, copies and transfers run on hcq's copy engines, and TinyJit batches become
one `hcq.HCQGraph` each."""
from __future__ import annotations

import sys
from typing import Any

def register() -> None:
    """Make tinygrad find device `HCQ` (idempotent). tinygrad looks a device up as module
    `tinygrad.runtime.ops_<name>`; this module is put there under that name."""
    import tinygrad.runtime
    from hcq.tinygrad import device
    sys.modules.setdefault("tinygrad.runtime.ops_hcq", device)
    setattr(tinygrad.runtime, "ops_hcq", device)  # (an attribute tinygrad's package does not declare)


def hcq_device_name(tinygrad_name: str) -> str:
    """The hcq device behind a tinygrad device name: `HCQ` -> `CPU:0`, `HCQ:2` -> `CPU:2` (or the entry of
    HCQ_TINYGRAD_DEVICES)."""
    from hcq.tinygrad.device import hcq_device_name as name_of
    return name_of(tinygrad_name)


def pytest_report_header(config: Any) -> str:
    """Say, at the top of a pytest run that loaded this plugin, which hcq devices tinygrad's HCQ devices are."""
    return f"hcq.tinygrad: device HCQ = hcq {hcq_device_name('HCQ')}, HCQ:1 = hcq {hcq_device_name('HCQ:1')}"


register()
