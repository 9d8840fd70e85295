"""Test servers shared by several test modules."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path
from typing import Callable

import httpx


@functools.lru_cache
def model_of(url: str) -> str:
    """The model name a server reports (the `model` of its requests)."""
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def fingerprint(server) -> tuple:
    """What a normal completion returns (seeded sampling with top-5 logprobs): any change of the weights changes it.
    `server`: .url, .model, and .headers (the API key, when the server has one)."""
    r = httpx.post(server.url + "/v1/completions", headers=getattr(server, "headers", {}), timeout=60, json={
        "model": server.model, "prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True, "seed": 11, "logprobs": 5})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return tuple(ch["token_ids"]), tuple(tuple(sorted(d.values())) for d in ch["logprobs"]["top_logprobs"])


def answers_normally(server) -> None:
    """The server is alive and answers a normal request exactly as when `server.ref` was taken."""
    assert server.proc.poll() is None, "server died"
    assert fingerprint(server) == server.ref


def openai_error(r: httpx.Response, status: int) -> dict:
    """The error of a response that must be `status` in OpenAI's shape: {"error": {"message", "type", "param",
    "code"}}."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def serve_model(model_dir: Path, *args: str):
    """`inflight serve` on a model folder in a subprocess (1 thread, 512 tokens of context), as a context manager:
    the body of a module's `server` fixture."""
    from inflight.engine.serve import ServerProcess

    return ServerProcess(str(model_dir), extra_args=["--max-model-len", "512", *args], env={"OMP_NUM_THREADS": "1"})


def generation_across_update(url: str, messages: list[dict], push: Callable[[], None], old: int, new: int,
                             n: int = 32) -> tuple[list[int], list[int], list[float], list[int]]:
    """Stream a long generation (choice 0 of `n`, up to the 512-token context), call `push` once its first token is
    out, and return (prompt ids, token ids, logprobs, versions) of a generation whose tokens span versions `old` then
    `new`. A lone sequence decodes in ~0.4 ms a token, faster than a push on a busy host: `n` choices slow each step
    (32: ~1.5 ms), and it tries up to 8 times."""
    for _attempt in range(8):
        got: dict = {"ids": [], "lps": [], "versions": [], "prompt": []}

        def generate() -> None:
            body = {"model": model_of(url), "messages": messages, "max_tokens": 480, "ignore_eos": True, "n": n,
                    "logprobs": True, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ch = json.loads(line[6:])["choices"][0]
                    if ch.get("index", 0) != 0:
                        continue
                    got["ids"].extend(ch.get("token_ids", []))
                    got["versions"].extend(ch.get("token_versions", []))
                    got["lps"].extend(e["logprob"] for e in (ch["logprobs"] or {}).get("content", []))
                    got["prompt"] = ch.get("prompt_token_ids", got["prompt"])

        t = threading.Thread(target=generate)
        t.start()
        while not got["ids"] and t.is_alive():
            time.sleep(0.005)
        push()
        t.join()
        if got["versions"] and got["versions"][0] == old and got["versions"][-1] == new:
            return got["prompt"], got["ids"], got["lps"], got["versions"]
    raise AssertionError("the generation never spanned the update")
