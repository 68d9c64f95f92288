"""Finding the C compiler and building shared objects into an on-disk cache keyed by a hash of the
source, the flags and the compiler's identity."""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from hcq.errors import CompileError


def cache_dir() -> Path:
    """HCQ_CACHE_DIR, else $XDG_CACHE_HOME/hcq, else ~/.cache/hcq."""
    base = os.environ.get("HCQ_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hcq")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def find_compiler() -> tuple[str, str]:
    """(path, version line) of the C compiler: $CC, else clang, else cc/gcc."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["clang", "cc", "gcc"]
    for cand in candidates:
        path = shutil.which(cand)
        if path is None: continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        return path, (out.splitlines() or ["unknown"])[0]
    raise CompileError(f"no C compiler found (tried {', '.join(candidates)}); install gcc or clang, or set CC")


def build_shared_object(source: str, flags: tuple[str, ...], tag: str) -> Path:
    """Compile C `source` into a shared object in the cache (reused when source, flags and compiler match)."""
    cc, version = find_compiler()
    key = hashlib.sha256("\0".join((source, " ".join(flags), cc, version)).encode()).hexdigest()[:24]
    out = cache_dir() / f"{tag}-{key}.so"
    if out.exists(): return out
    with tempfile.TemporaryDirectory(prefix="hcq-build-") as tmp:
        src = Path(tmp) / f"{tag}.c"
        src.write_text(source)
        tmp_out = Path(tmp) / "out.so"
        res = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(tmp_out), str(src)], capture_output=True, text=True)
        if res.returncode != 0:
            raise CompileError(f"{Path(cc).name} failed to compile {tag}:\n{_relabel(res.stderr, str(src), tag)}")
        final_tmp = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(tmp_out, final_tmp)
        os.replace(final_tmp, out)  # atomic: concurrent builders never see a half-written library
    return out


def _relabel(text: str, path: str, tag: str) -> str:
    return text.replace(path, f"<{tag}>").strip()
