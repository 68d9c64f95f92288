"""Small helpers shared by test modules (importable as `helpers`: pytest puts this folder on sys.path)."""
import numpy as np

from hcq import BufferSpec


def alloc(dev, nbytes, fill=0):
    """A host-visible buffer of `nbytes` set to `fill` (buffers may come back from the LRU cache with old bytes)."""
    buf = dev.allocator.alloc(nbytes, BufferSpec(cpu_access=True))
    buf.cpu_view()[:] = bytes([fill]) * nbytes
    return buf


def arr(buf, dtype=np.uint32):
    """The buffer's bytes as a numpy array (a view, no copy)."""
    return np.frombuffer(buf.cpu_view().mv, dtype=dtype)
