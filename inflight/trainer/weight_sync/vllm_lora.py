"""`trainer.protocol: vllm` with `trainer.lora`: LoRA adapters pushed to stock vLLM servers through vLLM's own LoRA
loading (unmerged: vLLM's LoRA layers add s * B @ A at every forward; no base weight is written).

The servers: `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve MODEL --enable-lora --max-lora-rank R --max-loras N`.
Each push:
    1. checks the adapter (pairs, rank, shapes against the base checkpoint when known, finite values): a bad one is
       refused here, before anything is written or sent;
    2. saves it in PEFT's format into a folder of its own, `<folder>/<name>-v<version>-<pid>-<n>` (adapter_config.json
       with r, lora_alpha = scaling * r; adapter_model.safetensors with PEFT's names). The servers read that path:
       they must see the same file system (same host, or a shared mount at the same path);
    3. POST /v1/load_lora_adapter {"lora_name": "<name>-v<version>", "lora_path": ..., "load_inplace": false} on every
       server (vLLM reads and checks the folder in its engine before it answers);
    4. unloads `<name>-v<old>` for versions `keep` or more pushes old (POST /v1/unload_lora_adapter) and deletes
       their folders one window later.

Exact versions. A new adapter name per version, never loaded in place: a request names the adapter it runs under
(`"model": "<name>-v<version>"`) and vLLM keeps a running request on the adapter it started with, so every token of
a request comes from that one version; the actor asks for the newest published version's name (actor/rollout.py)
and takes the version from the name the response carries. Hence no `interrupt` mode: a running request cannot be
moved to newer weights (refused at config time). Facts of vLLM 0.32 this relies on (read in its source:
vllm/entrypoints/openai/models/serving.py, vllm/lora/worker_manager.py): unloading only removes the name from the
API server, a request already running keeps its adapter; the engine keeps `--max-cpu-loras` adapters (default
`--max-loras`) and reloads an evicted one from its path when a request needs it again, so folders outlive their
names by one window; `load_inplace: true` marks the adapter to be read from disk again whenever a batch activates
it, which is why a name is never reused in place here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Iterable

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inflight.transport.schemas import ParamInfo, adapter_pairs, served_adapter_name
from inflight.transport.finite import nonfinite
from inflight.trainer.lora import to_peft_names
from inflight.trainer.weight_sync.common import DTYPE_NAMES, WeightSyncError, error_text, unique_tensors

log = logging.getLogger("inflight.trainer.weight_sync.vllm_lora")


class AdapterRejected(WeightSyncError):
    """The adapter failed the checks made before anything is written or sent ("(HTTP 400)": never retried)."""

    def __init__(self, problems: list[str]):
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
        super().__init__(f"adapter refused before sending (HTTP 400): {shown}; nothing was loaded")


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a model folder's safetensors files, from their headers (no tensor is read)."""
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = tuple(st.get_slice(k).get_shape())
    return out


class VLLMLoraSync:
    """WeightSyncClient's surface for adapter pushes to stock vLLM servers (no process group: world_size 1)."""

    protocol = "vllm"
    transport = "file"  # a folder the servers read: nothing to rejoin after a server restart
    world_size = 1

    def __init__(self, server_urls: list[str], folder: str | Path, *, name: str = "inflight-lora", keep: int = 3,
                 api_key: str | None = None, timeout_s: float = 600.0,
                 base_shapes: dict[str, tuple[int, ...]] | None = None, max_rank: int | None = None,
                 base_model: str | None = None):
        if not server_urls:
            raise ValueError("no server urls")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (adapters loaded at once), got {keep}")
        if not name or any(c.isspace() or c == "/" for c in name):
            raise ValueError(f"adapter name {name!r}: a non-empty name without spaces or '/'")
        self.urls = [u.rstrip("/") for u in server_urls]
        self.folder = Path(folder).absolute()
        self.name, self.keep, self.timeout_s = name, keep, timeout_s
        self.base_shapes, self.max_rank, self.base_model = base_shapes, max_rank, base_model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.loaded: list[tuple[int, str, Path]] = []  # (version, adapter name, folder) loaded on every server
        self.unloaded: list[tuple[int, Path]] = []  # names gone, folders kept one window longer (engine cache)
        self.pushes = 0

    # ---- HTTP ---------------------------------------------------------------------------------------------------
    def _post(self, url: str, path: str, body: dict) -> httpx.Response:
        try:
            return self.http.post(url + path, json=body)
        except httpx.TimeoutException as e:
            raise WeightSyncError(f"server {url}: {path} timed out after {self.timeout_s:.0f}s") from e
        except httpx.HTTPError as e:
            raise WeightSyncError(f"server {url}: {path} failed: {e}") from e

    @staticmethod
    def _message(r: httpx.Response) -> str:
        try:
            return error_text(r.json())
        except ValueError:
            return r.text[:500]

    def init_process_group(self) -> None:
        """No group to form: checks that every server serves LoRA at runtime (the load/unload routes exist only with
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) and, where vLLM's dev routes answer, reads its --max-lora-rank."""
        for url in self.urls:
            r = self._post(url, "/v1/unload_lora_adapter", {"lora_name": f"{self.name}-probe-{os.getpid()}"})
            if r.status_code == 404 and "cannot be found" not in self._message(r):
                raise WeightSyncError(f"server {url} has no /v1/unload_lora_adapter: start vLLM with "
                                      "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora (trainer.lora with "
                                      "trainer.protocol=vllm loads adapters at runtime)")
            if r.status_code not in (200, 404):
                raise WeightSyncError(f"server {url} rejected /v1/unload_lora_adapter (HTTP {r.status_code}): "
                                      f"{self._message(r)}")
            rank = self._server_max_rank(url)
            if rank is not None:
                self.max_rank = rank if self.max_rank is None else min(self.max_rank, rank)
        log.info("vllm LoRA loading ready on %d servers (max rank %s)", len(self.urls), self.max_rank)

    def _server_max_rank(self, url: str) -> int | None:
        """--max-lora-rank from vLLM's /server_info (served only with VLLM_SERVER_DEV_MODE=1), else None. A server
        started without --enable-lora (no lora_config) is an error."""
        try:
            r = self.http.get(url + "/server_info", params={"config_format": "json"}, timeout=60.0)
            cfg = r.json().get("vllm_config") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(cfg, dict) or "lora_config" not in cfg:
            return None
        if cfg["lora_config"] is None:
            raise WeightSyncError(f"server {url} was started without --enable-lora")
        return int(cfg["lora_config"]["max_lora_rank"])

    # ---- the adapter ----------------------------------------------------------------------------------------------
    def check(self, tensors: dict[str, torch.Tensor], rank: int, scaling: float) -> None:
        """Everything vLLM would refuse or serve wrong, found before anything is written: AdapterRejected."""
        problems = []
        if not math.isfinite(scaling):
            problems.append(f"scaling {scaling!r} is not a finite number")
        if self.max_rank is not None and rank > self.max_rank:
            problems.append(f"rank {rank} > the servers' --max-lora-rank {self.max_rank}")
        params = []
        for n, t in tensors.items():
            if t.dtype not in DTYPE_NAMES:
                problems.append(f"{n}: dtype {t.dtype} (float32, bfloat16, float16 only)")
                continue
            params.append(ParamInfo(name=n, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape)))
        try:
            pairs = adapter_pairs(params, rank)
        except ValueError as e:
            problems.append(str(e))
            pairs = {}
        if not tensors:
            problems.append("no tensors")
        for base, (a, b) in pairs.items():
            if self.base_shapes is None:
                break
            want = self.base_shapes.get(base)
            if want is None:
                problems.append(f"'{base}': not a weight of the base checkpoint")
            elif len(want) != 2 or [b.shape[0], a.shape[1]] != list(want):
                problems.append(f"'{base}': lora_B {b.shape} @ lora_A {a.shape} does not make its shape {list(want)}")
        bad = nonfinite(tensors)
        if bad:
            problems.append(f"NaN or Inf in {bad[:5]}")
        if problems:
            raise AdapterRejected(problems)

    def save(self, tensors: dict[str, torch.Tensor], rank: int, scaling: float, out: Path) -> None:
        """PEFT's format, as vLLM reads it: scaling = lora_alpha / r, so lora_alpha = scaling * r."""
        state = {k: t.detach().cpu().contiguous() for k, t in to_peft_names(iter(tensors.items())).items()}
        # full module names: PEFT adapts exactly these (a short name would match every layer)
        modules = {n.rsplit(".", 1)[0].removesuffix(".weight") for n in tensors}
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": float(scaling) * rank,
                  "target_modules": sorted(modules), "bias": "none", "use_rslora": False, "lora_dropout": 0.0,
                  "base_model_name_or_path": self.base_model}
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        tmp.rename(out)  # the servers never see a half-written folder

    # ---- push -----------------------------------------------------------------------------------------------------
    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int, mode: str = "keep",
             adapter: dict | None = None) -> dict:
        if adapter is None:
            raise WeightSyncError("trainer.protocol=vllm with trainer.lora pushes LoRA adapters only (no adapter "
                                  "spec given): full weights go through the native client (without trainer.lora)")
        if mode != "keep":
            raise ValueError(f"mode {mode!r}: a stock vLLM server keeps each running request on the adapter it "
                             "started with; only 'keep' exists here")
        t0 = time.perf_counter()
        tensors = {n: t.detach() for n, t in unique_tensors(named_weights)}
        rank, scaling = int(adapter["rank"]), float(adapter["scaling"])
        self.check(tensors, rank, scaling)
        self.pushes += 1
        name = served_adapter_name(self.name, version)
        out = self.folder / f"{name}-{os.getpid()}-{self.pushes}"
        self.save(tensors, rank, scaling, out)
        saved = time.perf_counter()
        try:
            self._load_all(name, out)
        except Exception:
            shutil.rmtree(out, ignore_errors=True)
            raise
        loaded = time.perf_counter()
        self.unloaded += [(v, p) for v, n, p in self.loaded if n == name]  # the same version pushed again
        self.loaded = [x for x in self.loaded if x[1] != name] + [(version, name, out)]
        self._retire()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        log.info("pushed %s to vllm: %d tensors, %.2f MB, save %.3fs, load %.3fs", name, len(tensors), nbytes / 1e6,
                 saved - t0, loaded - saved)
        return {"version": version, "bytes": nbytes, "seconds": time.perf_counter() - t0, "num_tensors": len(tensors),
                "adapter": {"rank": rank, "scaling": scaling, "name": name, "path": str(out)},
                "save_s": saved - t0, "load_s": loaded - saved}

    def _load_all(self, name: str, path: Path) -> None:
        """Load on every server; a name a server already holds (the same version pushed again: a retry, a resume) is
        unloaded first, so the name never points at older weights."""
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": False}
        errors = []
        for url in self.urls:  # one at a time: vLLM reads the folder in its engine loop, between decode steps
            r = self._post(url, "/v1/load_lora_adapter", body)
            if r.status_code == 400 and "already been loaded" in self._message(r):
                self._post(url, "/v1/unload_lora_adapter", {"lora_name": name})
                r = self._post(url, "/v1/load_lora_adapter", body)
            if r.status_code != 200:
                hint = (" (the server must read the folder at this same path: same host or a shared mount; "
                        "trainer.lora.served_dir)") if r.status_code == 404 else ""
                errors.append(f"server {url} rejected /v1/load_lora_adapter of {name} (HTTP {r.status_code}): "
                              f"{self._message(r)}{hint}")
        if errors:
            raise WeightSyncError(" | ".join(errors))

    def _retire(self) -> None:
        """Unload names `keep` pushes old; delete the folders of names unloaded a window ago."""
        while len(self.loaded) > self.keep:
            version, name, path = self.loaded.pop(0)
            for url in self.urls:
                r = self._post(url, "/v1/unload_lora_adapter", {"lora_name": name})
                if r.status_code not in (200, 404):
                    log.warning("server %s: unloading %s: HTTP %d %s", url, name, r.status_code, self._message(r))
            self.unloaded.append((version, path))
        while len(self.unloaded) > self.keep:
            shutil.rmtree(self.unloaded.pop(0)[1], ignore_errors=True)

    def close(self) -> None:
        self.http.close()
