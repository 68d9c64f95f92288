"""TinyJit batches as one `hcq.HCQGraph`: kernels become ExecItems, copies CopyItems (transfers between HCQ devices
run on the source device's copy engine), JIT inputs become the graph's input placeholders, tinygrad's Variables
hcq Variables, and symbolic launch dims variables whose values tinygrad computes on each run."""
from __future__ import annotations

from typing import Any

from tinygrad.device import Buffer, Compiled, MultiBuffer
from tinygrad.engine.jit import MultiGraphRunner
from tinygrad.uop.ops import Ops, UOp

import hcq

INT_MAX = (1 << 31) - 1


class HCQTinyGraph(MultiGraphRunner):
    """A tinygrad graph runner that replays a JIT batch as one hcq graph."""

    def __init__(self, linear: UOp, input_uops: tuple[UOp, ...] = ()):
        super().__init__(linear, input_uops)
        placeholders: dict[tuple[int, int], hcq.HCQBuffer] = {}  # (JIT input slot, device index) -> build-time buffer
        for (dev_idx, _, bufs, _), replace in zip(self.calls, self.uop_replace):
            for pos, slot in replace: placeholders.setdefault((slot, dev_idx), bufs[pos]._buf)
        self.input_keys = list(placeholders)
        self.dim_vars: dict[int, str] = {}  # call index -> variable holding its (symbolic) block count
        items = [self._item(j, ast, bufs, dv, rt) for j, ((_, ast, bufs, dv), rt) in enumerate(zip(self.calls, self.runtimes))]
        self.graph = hcq.HCQGraph(items, inputs=[placeholders[k] for k in self.input_keys])

    def _item(self, j: int, ast: UOp, bufs: list[Buffer], device_vars: dict[str, int], runtime: Any) -> hcq.ExecItem | hcq.CopyItem:
        hbufs = [b._buf for b in bufs]
        if ast.op is Ops.COPY: return hcq.CopyItem(hbufs[0], hbufs[1], bufs[0].nbytes)
        info = ast.arg
        vals = tuple(device_vars[v.expr] if v.expr in device_vars else hcq.Variable(v.expr, int(v.vmin), int(v.vmax))
                     for v in info.vars if v.expr not in info.runtimevars)
        blocks: Any = info.global_size[0]
        if not isinstance(blocks, int):
            self.dim_vars[j] = f"__tinygrad_blocks{j}"
            blocks = hcq.Variable(self.dim_vars[j], 1, INT_MAX)
        outs = tuple(info.globals.index(o) for o in info.outs if o in info.globals)
        return hcq.ExecItem(runtime.prg, tuple(hbufs[i] for i in info.globals), runtime.launch_args(vals), (blocks, 1, 1), (1, 1, 1), outs)

    @staticmethod
    def supports_uop(batch_devs: list[Compiled], new_call: UOp) -> bool:
        """Kernels and copies between HCQ devices (of one hcq peer group or several: remote devices of other servers)."""
        if not MultiGraphRunner.supports_uop(batch_devs, new_call): return False
        return all(hasattr(d, "hdev") for d in MultiGraphRunner._all_devs(batch_devs, new_call))

    def __call__(self, input_uops: tuple[UOp, ...], var_vals: dict[str, int], wait: bool = False) -> float | None:
        inputs = []
        for slot, dev_idx in self.input_keys:
            buf = input_uops[slot].buffer
            if isinstance(buf, MultiBuffer): buf = buf.bufs[dev_idx]
            inputs.append(buf.ensure_allocated()._buf)
        used = self.graph.variables
        vv = {k: v for k, v in var_vals.items() if k in used}
        if self.dim_vars:
            for j, global_size, _ in self.updated_launch_dims(var_vals):
                if j in self.dim_vars: vv[self.dim_vars[j]] = int(global_size[0])
        return self.graph(inputs, vv, wait=wait)
