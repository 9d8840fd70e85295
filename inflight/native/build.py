"""Building and loading the C kernels of the engine and the trainer (inflight/engine/model/cpu_kernels.c,
inflight/trainer/kernels/cpu_kernels.c; both include cpu_math.h from this folder).

Build: `cc -O3 -march=native` (plus the reassociation flags that let the reductions vectorize; not -ffast-math,
whose start-up code would change the whole process's denormal handling) into $INFLIGHT_KERNEL_DIR, else
~/.cache/inflight/kernels (XDG_CACHE_HOME honoured). The file is named by a hash of the source, the headers it
includes, the flags and the CPU, so a changed source or another CPU builds anew (~0.5 s); it is written to a
temporary name and renamed, so concurrent processes never load a partial file. Without a compiler, or with
INFLIGHT_CPU_KERNELS=0, `build_and_open` returns None and the callers use torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-shared", "-fPIC"]


def cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


def build(cc: str, out: Path, source: Path, flags: list[str] = FLAGS) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def kernel_dir() -> Path:
    if os.environ.get("INFLIGHT_KERNEL_DIR"):
        return Path(os.environ["INFLIGHT_KERNEL_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inflight" / "kernels"


def build_and_open(source: Path, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The library of one C source (built here once, see the header), or None with a warning."""
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: %s is not built, torch ops run instead", source.name)
        return None
    text = source.read_bytes()
    for name in re.findall(rb'#include "([^"]+)"', text):  # the headers it includes change the build too
        text += (source.parent / name.decode()).read_bytes()
    key = hashlib.sha256(text + " ".join([cc, *FLAGS, cpu_id()]).encode()).hexdigest()[:16]
    so = kernel_dir() / f"{source.stem}-{key}.so"
    try:
        if not so.exists():
            build(cc, so, source)
        return open_library(so, signatures)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build %s (%s): torch ops run instead", source.name, str(detail).strip()[:500])
        return None


def open_library(so: Path, signatures: dict[str, list]) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(so))
    for name, args in signatures.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib
