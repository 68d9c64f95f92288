"""The backend conformance kit: the behaviour every hcq device must show, as a pytest suite run against one device.

    python -m hcq.conformance DEVICE [-k EXPR] [-x] [-q | -v] [-- more pytest arguments]
    pytest -p hcq.conformance.plugin --hcq-device=DEVICE --pyargs hcq.conformance.suite

`DEVICE` is any name `hcq.Device()` opens: `CPU`, `CPU:1`, or a device of an out-of-tree backend. The suite uses
only the public API and the device's capability record (`dev.capabilities`, an `hcq.interfaces.Capabilities`):
a test of something a backend declares it cannot do (no `recover`, no `queue_states`, no host-visible memory, a
poll condition it does not offer...) is skipped, naming the capability. When a second device of the same kind
opens (`KIND:index+1`), transfers between the two are tested too.

The plugin (`hcq.conformance.plugin`, also registered as the pytest11 entry point `hcq-conformance`) adds the
option `--hcq-device` and, only when it is given, the fixtures `dev` (the device), `caps` (its capabilities),
`kernels` (its conformance kernels, compiled) and `dev2` (a second device of the kind, or a skip).

Kernel contract
---------------
A backend's device class (or, for a device that learns it when it opens, the device) provides
`CONFORMANCE_KERNELS: dict[str, tuple[str, str]]`, mapping a behaviour to
(source, kernel name) in the backend's own kernel language; the kit compiles each with `dev.compile(source,
name)`. Launches are 1-D: i is the global linear thread index over x (block index * threads per block + thread
index). Buffers are passed in `bufs`, scalars in `vals`, both in the order below; elements are uint32 unless
said otherwise.

    fill   bufs (out: uint32*)                     vals (value: uint32, n: uint32)
           out[i] = value for every i < n; nothing else is written.
    add    bufs (out, a, b: uint32*)               vals (n: uint32)
           out[i] = a[i] + b[i] (mod 2**32) for every i < n; nothing else is written. `out` may be `a`.
    spin   bufs (flag: uint64*, out: uint32*)      vals ()
           thread 0 spins until *flag != 0, reading it with a volatile or atomic (acquire) load each time,
           then stores out[0] = 1; other threads return at once.
    fault  bufs (out: uint32*)                     vals ()
           makes the device fail (a store through an invalid address, say), so the next synchronize or wait
           raises hcq.DeviceError. Optional: leave it out of the dict if the backend cannot fault on purpose;
           the tests that need it are skipped.

fill, add and spin are required. The CPU device's kernels are in `hcq.backends.cpu.kernels`.
"""
