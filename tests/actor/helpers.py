"""Test helpers: a real HTTP server (uvicorn in a thread) with scriptable behaviour, for the routing tests of
ServerPool (retries, 5xx, 4xx, timeouts). The actor's own tests run against the real `inflight serve`; for them, a
client that records what the server returned and a float64 check of an episode's logprobs."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from inflight.actor.rollout import RolloutClient
from tests.reliability.pipeline_helpers import free_port


class ScriptedServer:
    """Answers /v1/chat/completions in the built-in server's shape after `delay` s; the first `fail_first` calls get
    HTTP 500, every call gets `status` when it is set; records calls and the peak of concurrent requests."""

    def __init__(self, port: int | None = None, delay: float = 0.0, fail_first: int = 0, status: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.delay, self.fail_first, self.status = delay, fail_first, status
        self.calls = self.active = self.peak = 0
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.calls += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                await asyncio.sleep(self.delay)
                if self.status is not None:
                    return JSONResponse({"error": {"message": "scripted"}}, self.status)
                if self.calls <= self.fail_first:
                    return JSONResponse({"error": {"message": "scripted failure"}}, 500)
                n = int(body.get("n", 1))
                choices = [
                    {"index": i, "message": {"role": "assistant", "content": f"c{i}"}, "finish_reason": "stop",
                     "token_ids": [10 + i, 11], "prompt_token_ids": [1, 2, 3], "token_versions": [7, 7],
                     "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]}}
                    for i in range(n)
                ]
                return {"id": "x", "object": "chat.completion", "choices": choices}
            finally:
                self.active -= 1

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ScriptedServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("scripted server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class TrainerStub:
    """A trainer that trains on nothing: takes `groups_per_step` groups per step from the stream, waits `step_s`,
    pushes a (partial, value-preserving) weight update of version v+1 to every server over the real contract, then
    publishes v+1. Records, per consumed group, the version it was consumed at."""

    def __init__(self, stream, urls: list[str], gps: int, steps: int, weights_path: str, step_s: float = 0.05):
        self.stream, self.urls, self.gps, self.steps = stream, urls, gps, steps
        self.path, self.step_s = weights_path, step_s
        self.consumed: list[tuple[int, list]] = []  # (trainer version when consumed, group)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "TrainerStub":
        set_version(self.urls, self.path, 0, new_run=True)  # the run starts from the initial weights, v0
        self.stream.publish_version(0)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            for v in range(self.steps):
                got: list = []
                deadline = time.monotonic() + 120
                while len(got) < self.gps:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"trainer stub starved at version {v} with {len(got)} groups")
                    got += self.stream.get(self.gps - len(got), timeout_s=0.5)
                self.consumed += [(v, g) for g in got]
                time.sleep(self.step_s)
                set_version(self.urls, self.path, v + 1)
                self.stream.publish_version(v + 1)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def join(self, timeout: float = 120) -> None:
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error


def set_version(urls: list[str], weights_path: str, version: int, new_run: bool = False) -> None:
    """A real weight update (safetensors file transport) that sets the servers' weight version (`new_run`: a
    trainer's first update, which may go back, as a test's new run on a server shared with earlier tests)."""
    import httpx

    for url in urls:
        r = httpx.post(url + "/request_weight_update", json={"version": version, "path": weights_path,
                                                             "new_run": new_run}, timeout=30)
        r.raise_for_status()


class Recording(RolloutClient):
    """The real client, keeping every completion the server returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    async def chat(self, *a, **kw):
        out = await super().chat(*a, **kw)
        self.seen += out
        return out

    async def complete(self, *a, **kw):
        out = await super().complete(*a, **kw)
        self.seen += out
        return out


# A float32 engine differs from the float64 forward by rounding only (~1e-7 on the tiny model). A completion whose
# RoPE positions are one off (a gap after the prompt) moves these logprobs by 1e-4 to 8e-4: the bound lies between.
LOGPROB_TOL = 1e-5


def float64_logprobs(model_dir, s, position_shift: int = 0) -> list[float]:
    """The float64 forward's logprob of every model token of episode sample `s` (loss mask 1), in the context of
    the whole episode; `position_shift` moves the completion's positions (what an off-by-one engine would use)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    P, ids = len(s.prompt_ids), s.prompt_ids + s.completion_ids
    positions = torch.arange(len(ids))
    positions[P:] += position_shift
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]), position_ids=positions[None]).logits[0], -1)
    return [lp[P + j - 1, t].item() for j, (t, m) in enumerate(zip(s.completion_ids, s.loss_mask, strict=True)) if m]


def assert_model_logprobs_float64(model_dir, s) -> None:
    """Every model token of episode sample `s` (loss mask 1) has the behaviour logprob of a float64 forward over the
    whole episode, within LOGPROB_TOL."""
    got = [lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]
    want = float64_logprobs(model_dir, s)
    assert got, "no model tokens to check"
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < LOGPROB_TOL, f"behaviour logprobs differ from the float64 forward by up to {worst:.2e}"
