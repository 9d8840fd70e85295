"""Put on PYTHONPATH with INFLIGHT_AS_GPU_IMAGE=1: every Python process then sees only the standard library, this
repository, and the packages that the GPU image holds or that are carried to it (scripts/gpu_imports.py). The CPU
dry run of the bench runs under it in CI (tests/test_gpu_scripts.py)."""

import os

if os.environ.get("INFLIGHT_AS_GPU_IMAGE") == "1":
    import importlib.util
    import sys

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_imports.py")
    _spec = importlib.util.spec_from_file_location("_inflight_gpu_imports", _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod  # dataclasses and the like look the module up by name
    _spec.loader.exec_module(_mod)
    _mod.install()
