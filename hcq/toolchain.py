"""Finding the C compiler and building shared objects into an on-disk cache keyed by a hash of the
source, the flags and the compiler's identity, and, for builds whose flags ask for code for this machine's CPU
(`-march=native`, `-mcpu=native`, `-mtune=native`, wherever the flags came from), the host CPU's model and flags.

The cache is trusted only as far as it can be checked: the directory must be owned by this user and not
writable by group or others (else a private temporary directory is used, with a warning), and an entry is
used only when it is a regular file (not a symlink) owned by this user, not writable by group or others,
whose sha256 matches its sidecar (`<entry>.meta`, which also records the sha256 of every header the build
read); anything else is rebuilt. Entries are written to a unique temporary file in the cache directory and
moved into place with os.replace(), so a reader never sees a partly written file."""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

from hcq import compile_server
from hcq.errors import CompileError
from hcq.helpers import getenv, kill_process_group

TIMEOUT_VAR = "HCQ_COMPILE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
_SET_CACHE = "set HCQ_CACHE_DIR to a directory you own that only you can write"


class CacheWarning(RuntimeWarning):
    """The configured compile cache cannot be used; a private temporary one is used instead."""


_fallback: Path | None = None  # this process's private cache, made on first need
_warned: set[str] = set()  # problems already reported
_fallback_lock = threading.Lock()


def configured_cache_dir() -> str:
    """HCQ_CACHE_DIR, else $XDG_CACHE_HOME/hcq, else ~/.cache/hcq."""
    return os.environ.get("HCQ_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hcq")


def cache_dir() -> Path:
    """The configured cache directory (created with mode 0700), or this process's private temporary one when it
    cannot be created or is not safe (owned by someone else, writable by group or others); the problem is
    reported once as a CacheWarning."""
    path = configured_cache_dir()
    problem = _dir_problem(path)
    return Path(path) if problem is None else _fallback_dir(problem)


def _dir_problem(path: str) -> str | None:
    """Why `path` cannot serve as the cache directory, or None when it can."""
    if path.startswith("~"): return f"no home directory to put the compile cache in ({path})"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        return f"cannot create the compile cache directory {path} ({e.strerror or e})"
    if st.st_uid != os.geteuid():
        return f"the compile cache directory {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"the compile cache directory {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}; chmod 700 it)"
    if not os.access(path, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return f"the compile cache directory {path} is not writable"
    return None


def _fallback_dir(problem: str) -> Path:
    """This process's private cache directory (made once, mode 0700, removed at exit); warns once per distinct
    `problem`."""
    global _fallback
    with _fallback_lock:
        if _fallback is None or _dir_problem(str(_fallback)) is not None:
            try:
                _fallback = Path(tempfile.mkdtemp(prefix="hcq-cache-"))
            except OSError as e:
                raise CompileError(f"{problem}, and no private temporary directory could be made ({e}); {_SET_CACHE}") from e
            atexit.register(shutil.rmtree, _fallback, True)
        if problem in _warned: return _fallback
        _warned.add(problem)
        warnings.warn(f"hcq: {problem}; compiling into the private temporary directory {_fallback} for this process instead "
                      f"(nothing is reused across processes). To fix it, {_SET_CACHE}.", CacheWarning, stacklevel=3)
    return _fallback


def read_trusted(path: Path, sha256: str | None = None) -> bytes | None:
    """The contents of cache entry `path` if it is trustworthy: a regular file (symlinks are not followed) owned by
    this user, not writable by group or others and, when `sha256` is given, with that digest. None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022: return None
        data = f.read()
    return data if sha256 is None or hashlib.sha256(data).hexdigest() == sha256 else None


def store(path: Path, data: bytes, mode: int) -> None:
    """Write cache entry `path` atomically with permission bits `mode`: into a unique temporary file in the same
    directory, then os.replace(), so readers see the old entry or the whole new one, never a partial file."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with open(fd, "wb") as f:
                os.fchmod(fd, mode)
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError): os.unlink(tmp)
            raise
    except OSError as e:
        raise CompileError(f"cannot write the compile cache entry {path} ({e.strerror or e}); {_SET_CACHE}") from e


def file_sha256(path: str) -> str | None:
    """sha256 of the file at `path`, or None when it cannot be read."""
    try:
        with open(path, "rb") as f: return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


CompilerIdentity = tuple[str, str, tuple[int, ...]]  # (path, version line, fingerprint of the binary)
_adopted: dict[tuple[str, tuple[int, ...]], str] = {}  # (path, fingerprint) -> version line, handed over (adopt_compiler)


@functools.lru_cache(maxsize=None)
def find_compiler() -> tuple[str, str]:
    """(path, version line) of the C compiler: $CC, else clang, else cc/gcc. The version line is asked of the compiler
    (`--version`, about 30 ms), unless another process handed it over for the same binary (adopt_compiler)."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["clang", "cc", "gcc"]
    for cand in candidates:
        path = shutil.which(cand)
        if path is None: continue
        if (version := _adopted.get((path, _fingerprint(path)))) is not None: return path, version
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        return path, (out.splitlines() or ["unknown"])[0]
    raise CompileError(f"no C compiler found (tried {', '.join(candidates)}); install gcc or clang, or set CC")


def _fingerprint(path: str) -> tuple[int, ...]:
    """What tells one binary at `path` from another put there later: (device, inode, size, mtime, ctime); () if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def found_compiler() -> CompilerIdentity | None:
    """The compiler find_compiler() found in this process, with its binary's fingerprint, for handing to worker
    processes; None when it has not been asked yet (nothing is run here)."""
    if not find_compiler.cache_info().currsize: return None
    path, version = find_compiler()
    return path, version, _fingerprint(path)


def adopt_compiler(found: CompilerIdentity) -> None:
    """Take `found` (another process's found_compiler(), e.g. a parent's in its compile workers) as the version line of
    that binary: find_compiler() then uses it without running the compiler, if it picks the same path and the binary
    there still has the same fingerprint."""
    path, version, fingerprint = found
    if fingerprint: _adopted[(path, tuple(fingerprint))] = version


def compile_timeout() -> float:
    """HCQ_COMPILE_TIMEOUT_S (default 300): how long one compiler run may take."""
    return getenv(TIMEOUT_VAR, DEFAULT_TIMEOUT_S, lo=0.001)  # (a positive number of seconds)


# The compiler gets a process group of its own (killed whole on timeout) but stays in the caller's session: where the
# kernel groups processes for scheduling by session (autogroup, on by default in most distributions), a compiler in
# a session of its own gets as much CPU as the caller's whole session, and a busy machine starves the device's threads.
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def run_compiler(cmd: list[str], what: str) -> tuple[int, str]:
    """Run compiler command `cmd` in its own process group: (exit status, its output). Compile steps go to this
    process's compile server when it can take them (see hcq.compile_server). Past HCQ_COMPILE_TIMEOUT_S the compile
    (its whole process group) is killed and CompileError raised."""
    timeout = compile_timeout()
    try:
        if (served := compile_server.run(cmd, timeout, _compile_server_shim, _OWN_GROUP)) is not None: return served
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **_OWN_GROUP) as proc:
            try:
                output, _ = proc.communicate(timeout=timeout)
            except BaseException:
                kill_process_group(proc)
                raise
    except subprocess.TimeoutExpired:
        raise CompileError(f"{Path(cmd[0]).name} did not finish compiling {what} within {timeout:g} s and was stopped; "
                           f"set {TIMEOUT_VAR} to allow it longer") from None
    return proc.returncode, output.decode(errors="replace")


def _compile_server_shim() -> Path:
    """The compile server's preload library, built (by a compile and link step the server does not take) and cached."""
    return build_shared_object(compile_server.SOURCE.read_text(), ("-O2", "-std=gnu11", "-fvisibility=hidden", "-ldl"), "hcq-compile-server")


def depfile_paths(text: str) -> list[str]:
    """The prerequisites in a make-style dependency file with one rule (as written by `-MMD -MT <target>`)."""
    _, _, deps = text.replace("\\\r\n", " ").replace("\\\n", " ").partition(":")
    return [re.sub(r"\\([ #])", r"\1", tok).replace("$$", "$") for tok in re.findall(r"(?:\\ |\S)+", deps)]


def _meta_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".meta")


def _fresh_data(entry: Path) -> bytes | None:
    """The contents of `entry` when it and its sidecar are trustworthy, the entry matches the sidecar's sha256, and
    every dependency the sidecar records still exists with the recorded contents; else None."""
    raw = read_trusted(_meta_path(entry))
    if raw is None: return None
    try:
        meta = json.loads(raw)
        digest, deps = str(meta["sha256"]), dict(meta["deps"])
    except (ValueError, KeyError, TypeError):
        return None
    data = read_trusted(entry, digest)
    return data if data is not None and all(isinstance(h, str) and file_sha256(p) == h for p, h in deps.items()) else None


def _compile(cc: str, source: str, flags: tuple[str, ...], tag: str, keep_object: Callable[[bytes], bool] | None = None
             ) -> tuple[bytes, dict[str, str | None]]:
    """Compile `source` into a shared object: (its bytes, {header path: sha256} of the headers it read). With
    `keep_object`, the relocatable object itself when keep_object(its bytes) says so (a loader of its own takes it).
    A build that links nothing (-nostdlib) is compiled to an object and linked by `ld` itself: the compiler
    driver's own link step costs about as much as compiling a small kernel."""
    with tempfile.TemporaryDirectory(prefix="hcq-build-") as tmp:
        src, out, dep, obj = Path(tmp) / f"{tag}.c", Path(tmp) / "out.so", Path(tmp) / "out.d", Path(tmp) / "out.o"
        src.write_text(source)
        deps = ["-MMD", "-MF", str(dep), "-MT", "hcq"]
        libs = [f for f in flags if f.startswith("-l")]
        compile_flags = [f for f in flags if f not in libs]
        ld = shutil.which("ld") if "-nostdlib" in flags and not libs else None
        if ld or keep_object is not None:
            _run_step([cc, *compile_flags, "-c", "-fPIC", *deps, "-o", str(obj), str(src)], tag, src)
            if keep_object is not None and keep_object(data := obj.read_bytes()): return data, _dep_hashes(dep, src)
            _run_step([ld, "-shared", "-o", str(out), str(obj)] if ld else [cc, *compile_flags, "-shared", "-o", str(out), str(obj), *libs],
                      tag, src, link=True)
        else:
            _run_step([cc, *compile_flags, "-shared", "-fPIC", *deps, "-o", str(out), str(src), *libs], tag, src)
        return out.read_bytes(), _dep_hashes(dep, src)


def _run_step(cmd: list[str], tag: str, src: Path, link: bool = False) -> None:
    rc, output = run_compiler(cmd, tag)
    if rc != 0: raise CompileError(f"{Path(cmd[0]).name} failed to {'link' if link else 'compile'} {tag}:\n{_relabel(output, str(src), tag)}")


def _dep_hashes(dep: Path, src: Path) -> dict[str, str | None]:
    paths = depfile_paths(dep.read_text()) if dep.exists() else []
    return {p: file_sha256(p) for p in paths if p != str(src)}


_NATIVE_FLAG_RE = re.compile(r"-m(?:arch|cpu|tune)=native\b")


@functools.lru_cache(maxsize=None)
def host_cpu_tag() -> str:
    """A short tag naming this host's CPU model and flags (code built with -march=native runs only on such CPUs)."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        info = ""
    fields = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return hashlib.sha256("\n".join(sorted(set(fields))).encode()).hexdigest()[:12]


def host_key(flags: tuple[str, ...]) -> tuple[str, ...]:
    """What of the host goes into the cache key of a build with `flags`: its CPU (host_cpu_tag) when a flag asks for
    code for this machine's CPU (-march, -mcpu or -mtune=native, also inside a -Wa,/-Xclang-style list), else nothing,
    so a cache shared by different machines hands a native build only to the CPU it was made for."""
    return (f"host-cpu={host_cpu_tag()}",) if any(_NATIVE_FLAG_RE.search(f) for f in flags) else ()


def build_shared_object(source: str, flags: tuple[str, ...], tag: str) -> Path:
    """Compile C `source` into a shared object in the cache; a verified entry for the same source, flags, compiler and
    (for native code: host_key) host CPU whose recorded headers are unchanged is reused without running the compiler."""
    cc, version = find_compiler()
    out = _entry(tag, (source, " ".join(flags), cc, version, *host_key(flags)), ".so")
    _cached(out, lambda: _compile(cc, source, flags, tag), 0o700)
    return out


def build_library(source: str, flags: tuple[str, ...], tag: str, keep_object: Callable[[bytes], bool], loader: str) -> bytes:
    """The bytes of C `source` built for a loader of its own (`loader` names it and its version, for the cache key):
    the relocatable object where keep_object(it) is true, else a shared object. Cached as build_shared_object caches."""
    cc, version = find_compiler()
    return _cached(_entry(tag, (source, " ".join(flags), cc, version, loader, *host_key(flags)), ".lib"),
                   lambda: _compile(cc, source, flags, tag, keep_object), 0o600)


def _relabel(text: str, path: str, tag: str) -> str:
    return text.replace(path, f"<{tag}>").strip()


def cached_build(tag: str, key_parts: tuple[str, ...], suffix: str, build: Callable[[], bytes]) -> bytes:
    """The bytes `build()` makes for inputs `key_parts` (source, flags, tool identity), through the same trusted cache
    as shared objects: a verified entry is reused without building; a new one is stored atomically."""
    return _cached(_entry(tag, key_parts, suffix), lambda: (build(), {}), 0o600)


def _entry(tag: str, key_parts: tuple[str, ...], suffix: str) -> Path:
    return cache_dir() / f"{tag}-{hashlib.sha256(chr(0).join(key_parts).encode()).hexdigest()[:24]}{suffix}"


def _cached(out: Path, build: Callable[[], tuple[bytes, dict[str, str | None]]], mode: int) -> bytes:
    """Cache entry `out`'s verified contents, else what build() makes ((bytes, recorded dependencies)), stored."""
    if (data := _fresh_data(out)) is not None: return data
    data, deps = build()
    store(out, data, mode)
    store(_meta_path(out), json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "deps": deps}).encode(), 0o600)
    return data


def inline_include(source: str, name: str, header: str, file: str) -> str:
    """`source` (of `file`) with the line `#include "name"` replaced by `header` (sources are built from one text, so
    a header's content is part of what the build cache keys on)."""
    include = f'#include "{name}"'
    lines = source.split("\n")
    at = [i for i, ln in enumerate(lines) if ln.startswith(include)]
    if len(at) != 1: raise RuntimeError(f"{file} must include {name} exactly once")
    lines[at[0]] = f'{header.rstrip()}\n#line {at[0] + 2} "{file}"'
    return "\n".join(lines)
