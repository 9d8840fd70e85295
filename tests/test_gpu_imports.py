"""The GPU window's imports rehearsed on CPU (scripts/gpu_imports.py): every module the bench's stages import
imports with only the standard library, this repository, the GPU image's packages (the list in docs/backends.md)
and the carried wheels (scripts/gpu-wheels.sh) visible, so a wheel missing from the carry list fails here. The CPU
dry run of the whole bench runs under the same guard (tests/test_gpu_scripts.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_imports  # noqa: E402  (scripts/ is not a package)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          cwd=SCRIPTS.parent, env={**os.environ, **env})


def test_bench_imports_as_on_the_gpu_image():
    p = subprocess.run([sys.executable, str(SCRIPTS / "gpu_imports.py"), "--as-gpu-image"], capture_output=True,
                       text=True, timeout=300)
    n = len(gpu_imports.MODULES)
    assert p.returncode == 0 and f"{n} of {n} modules import (as on the GPU image)" in p.stdout, p.stdout + p.stderr


def test_lists_read_from_the_docs_and_the_wheel_script():
    image, carried = gpu_imports.image_packages(), gpu_imports.carried_packages()
    assert {"torch", "transformers", "triton", "numpy", "msgpack", "matplotlib"} <= image and len(image) > 150
    assert {"fastapi", "uvicorn", "pydantic", "omegaconf", "orjson", "redis"} <= carried
    assert not {"vllm", "flash-attn", "fastapi", "omegaconf"} & image


def test_a_package_neither_listed_nor_carried_is_absent():
    """With msgpack on neither list, the streams fail to import as they would on such an image, and
    importlib.util.find_spec says it is not there (transformers' optional probes see the image's answer)."""
    p = _python("""
        import importlib.util, sys
        sys.path.insert(0, "scripts")
        import gpu_imports as g
        guard = g.install(image=g.image_packages() - {"msgpack"})
        assert importlib.util.find_spec("msgpack") is None
        import json, torch  # the standard library and the image's packages pass
        try:
            import inflight.streams.serialize
        except ModuleNotFoundError as e:
            print("refused:", e.name, "msgpack" in guard.refused)
    """)
    assert "refused: msgpack True" in p.stdout, p.stdout + p.stderr


def test_report_without_matplotlib(tmp_path):
    """A machine without matplotlib: `inflight train`'s report still writes report.html (tables, replies,
    config) and summary.json, saying the plots are missing, instead of failing the run."""
    p = _python(f"""
        import sys
        sys.path[:0] = ["scripts", "."]
        import gpu_imports as g
        g.install(image=g.image_packages() - {{"matplotlib"}})
        from tests.pipeline.test_report_and_docs import _fake_run
        from inflight.report.page import write_report
        _fake_run({str(tmp_path)!r}, 4, 0.3, 0.2)
        print(write_report([{str(tmp_path)!r}]))
        assert "matplotlib" not in sys.modules
    """)
    assert p.returncode == 0, p.stdout + p.stderr
    html = (tmp_path / "report.html").read_text()
    assert "No plots: matplotlib is not installed" in html and "<table>" in html
    assert (tmp_path / "summary.json").exists() and not list((tmp_path / "plots").glob("*.png"))
