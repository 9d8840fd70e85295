"""No path from the network reaches unpickling, code evaluation, or unsafe loaders: the package source (every
module under inflight/, parsed with `ast`, so comments and strings do not count) must not call any of them.

Allowed on purpose, and why:
- inflight/rewards/pool.py, inflight/streams/memory.py: multiprocessing pipes/queues pickle between this process
  and the children it started (never bytes from a socket); they do not import pickle themselves.
- the sandbox child (inflight/rewards/sandbox.py) runs model output with exec(), but that code is a string passed
  to a separate, resource-limited interpreter, not a call in the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import inflight

PKG = Path(inflight.__file__).parent
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def problems_in(source: str, filename: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("eval", "exec", "__import__"):
                out.append(f"{where}: {f.id}()")
            elif isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else ""
                if f.attr == "load" and owner == "torch" and not _is_true(_kw(node, "weights_only")):
                    out.append(f"{where}: torch.load without weights_only=True")
                if f.attr in ("load", "load_all") and owner == "yaml":
                    loader = _kw(node, "Loader")
                    if not (isinstance(loader, ast.Attribute) and loader.attr in ("SafeLoader", "CSafeLoader")):
                        out.append(f"{where}: yaml.{f.attr} without SafeLoader")
                if f.attr in ("unsafe_load", "full_load") and owner == "yaml":
                    out.append(f"{where}: yaml.{f.attr}")
                if f.attr == "load" and owner in ("np", "numpy") and _is_true(_kw(node, "allow_pickle")):
                    out.append(f"{where}: numpy.load(allow_pickle=True)")
                if f.attr in ("loads", "load", "Unpickler") and owner in BANNED_MODULES:
                    out.append(f"{where}: {owner}.{f.attr}")
            if _is_true(_kw(node, "trust_remote_code")):
                out.append(f"{where}: trust_remote_code=True (runs code shipped with a model folder)")
    return out


def test_the_checker_catches_each_pattern():
    bad = """
import pickle
from marshal import loads
import torch, yaml, numpy as np
torch.load(f)
torch.load(f, weights_only=False)
yaml.load(s)
yaml.unsafe_load(s)
np.load(f, allow_pickle=True)
eval(text)
exec(code)
AutoModel.from_pretrained(p, trust_remote_code=True)
"""
    assert len(problems_in(bad, "bad.py")) == 10, problems_in(bad, "bad.py")
    good = """
import torch, yaml
torch.load(f, weights_only=True)
yaml.load(s, Loader=yaml.SafeLoader)
yaml.safe_load(s)
model.eval()
s = "eval(x) exec(y) import pickle"
"""
    assert problems_in(good, "good.py") == []


def test_package_has_no_unsafe_deserialization_or_eval():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 30 and any(f.name == "server.py" for f in files)
    found = []
    for path in files:
        found += problems_in(path.read_text(), str(path.relative_to(PKG.parent)))
    assert found == [], "\n".join(found)
