"""hcq's benchmark suite (not a test, not run by CI, not a project dependency).

    python -m hcq.bench [--install-peers] [--quick] [--only rt,pipe,graph,copy,compute,signal,vk] [--peers pocl,tinygrad,raw,wgpu]

Measures hcq's CPU device against the peers a user would pick instead, side by side in one run (issue 5):
PyOpenCL on PoCL, tinygrad's CPU device (TinyJit), and numpy `copyto` (memcpy) for copies. Prints a table
(metric, hcq, each peer, ratio, target met or not) and writes hcq-bench.json.

Modules: `common` (timing, machine facts, load sampling), `ours` (hcq measurements), `peers` (peer
installation/detection and the peer measurements, each peer in its own process), `report` (rows, targets,
table), `vulkan` with `vk_peers` and `vk_raw.c` (the VK section: hcq's Vulkan device against a raw Vulkan loop in C and
wgpu), `grid_speedup` (the 1-vs-all-workers compute kernel, also runnable alone), `probe` (the
break-downs behind BENCHMARKS.md's analysis: `python -m tools.probe launch|graph|contention|placement|align`)."""
