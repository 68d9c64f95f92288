"""Two network namespaces joined by a veth pair, as two hosts on one machine (root and iproute2 only): for measuring
and testing what crosses a network. Addresses from TEST-NET-1 (192.0.2.101 and .102)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Any

SERVER_IP, CLIENT_IP = "192.0.2.101", "192.0.2.102"


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, or the kernel refuses)."""


class Netns:
    """`srv` and `cli`, joined by veth `vs` (in srv) <-> `vc` (in cli); removed, with whatever runs in them, on close."""

    def __init__(self, cwd: str | None = None) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None: raise NetnsUnavailable("needs root and iproute2 to make network namespaces")
        tag = f"{os.getpid() % 100000}"
        self.cwd = cwd
        self.srv, self.cli, self.vs, self.vc = f"hcqs{tag}", f"hcqc{tag}", f"hvs{tag}", f"hvc{tag}"
        steps = [["ip", "netns", "add", self.srv], ["ip", "netns", "add", self.cli],
                 ["ip", "link", "add", self.vs, "type", "veth", "peer", "name", self.vc],
                 ["ip", "link", "set", self.vs, "netns", self.srv], ["ip", "link", "set", self.vc, "netns", self.cli],
                 ["ip", "-n", self.srv, "addr", "add", f"{SERVER_IP}/24", "dev", self.vs],
                 ["ip", "-n", self.cli, "addr", "add", f"{CLIENT_IP}/24", "dev", self.vc],
                 ["ip", "-n", self.srv, "link", "set", self.vs, "up"], ["ip", "-n", self.cli, "link", "set", self.vc, "up"],
                 ["ip", "-n", self.srv, "link", "set", "lo", "up"], ["ip", "-n", self.cli, "link", "set", "lo", "up"]]
        for step in steps:
            r = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                self.close()
                raise NetnsUnavailable(f"cannot make network namespaces here ({' '.join(step)}: {r.stderr.strip()})")

    def popen(self, ns: str, argv: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen:
        """argv run in namespace `ns` (self.srv or self.cli), with `env` over this process's environment."""
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env={**os.environ, **env}, cwd=self.cwd, text=True, **kw)

    def close(self) -> None:
        for ns in (self.srv, self.cli):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
