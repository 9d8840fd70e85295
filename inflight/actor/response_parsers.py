"""Read generated tokens out of a chat-completion response, whatever server produced it.

Chat completions and text completions (/v1/completions, a prompt of token ids: how a multi-turn episode continues)
parse alike. Each server family puts the sampled token ids, their logprobs and the weight versions in slightly different places;
an adapter turns one response into a list of `Completion`s (one per choice), exactly as the server returned them.
A backend names its adapter in its registration (inflight/backends.py, `adapter`): `actor.adapter=NAME` is the
adapter of the backend NAME; `parse_x(response_json) -> list[Completion]` may live anywhere importable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from inflight import backends


class ResponseError(ValueError):
    """A response that does not carry what the inference contract promises (a server bug, never retried)."""


@dataclass
class Completion:
    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each generated token, as sampled
    versions: list[int]  # weight version that produced each generated token
    finish_reason: str
    model: str = ""  # the response's "model": the name the server says it served (a LoRA adapter's, on vLLM)


def _logprobs(choice: dict[str, Any]) -> list[float]:
    lp = choice.get("logprobs") or {}
    if lp.get("content") is None and lp.get("token_logprobs") is not None:  # a text completion (/v1/completions)
        return [float(x) for x in lp["token_logprobs"]]
    if lp.get("content") is None:
        raise ResponseError("choice has no logprobs.content (send logprobs=true; /v1/completions: logprobs=0)")
    return [float(c["logprob"]) for c in lp["content"]]


def _text(choice: dict[str, Any]) -> str:
    """The choice's text: message.content of a chat completion, text of a text completion."""
    if "message" in choice:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _check(c: Completion) -> Completion:
    n = len(c.token_ids)
    if len(c.logprobs) != n or len(c.versions) != n:
        raise ResponseError(
            f"inconsistent choice: {n} token_ids, {len(c.logprobs)} logprobs, {len(c.versions)} token_versions"
        )
    return c


def parse_builtin(resp: dict[str, Any]) -> list[Completion]:
    """inflight's own server: every choice carries token_ids, prompt_token_ids and token_versions."""
    out = []
    for ch in sorted(resp.get("choices", []), key=lambda c: c.get("index", 0)):
        missing = [k for k in ("token_ids", "prompt_token_ids", "token_versions") if ch.get(k) is None]
        if missing:
            raise ResponseError(f"choice lacks the contract's extension fields {missing}")
        out.append(
            _check(
                Completion(
                    text=_text(ch),
                    prompt_ids=[int(t) for t in ch["prompt_token_ids"]],
                    token_ids=[int(t) for t in ch["token_ids"]],
                    logprobs=_logprobs(ch),
                    versions=[int(v) for v in ch["token_versions"]],
                    finish_reason=ch.get("finish_reason") or "stop",
                )
            )
        )
    if not out:
        raise ResponseError("response has no choices")
    return out


def parse_vllm(resp: dict[str, Any]) -> list[Completion]:
    """vLLM with return_token_ids: prompt_token_ids at the top level, token_ids per choice. Per-token versions are
    not returned per token; a choice-level `weight_version` (or the response's) is spread over its tokens."""
    prompt = resp.get("prompt_token_ids")
    out = []
    for ch in sorted(resp.get("choices", []), key=lambda c: c.get("index", 0)):
        ids = ch.get("token_ids")
        p = ch.get("prompt_token_ids", prompt)
        if ids is None or p is None:
            raise ResponseError("vLLM response lacks token_ids / prompt_token_ids (start it with return_token_ids)")
        versions = ch.get("token_versions")
        if versions is None:
            v = ch.get("weight_version", resp.get("weight_version", -1))
            versions = [int(v)] * len(ids)
        out.append(
            _check(
                Completion(
                    text=_text(ch),
                    prompt_ids=[int(t) for t in p],
                    token_ids=[int(t) for t in ids],
                    logprobs=_logprobs(ch),
                    versions=[int(v) for v in versions],
                    finish_reason=ch.get("finish_reason") or "stop",
                    model=str(resp.get("model") or ""),
                )
            )
        )
    if not out:
        raise ResponseError("response has no choices")
    return out


def parse_sglang(resp: dict[str, Any]) -> list[Completion]:
    """SGLang (0.5.x) with return_token_ids: token_ids and prompt_token_ids per choice (vLLM's shape); the weight
    version, when the server reports one, is the choice's meta_info.weight_version (else -1)."""
    choices = []
    for ch in resp.get("choices", []):
        v = str((ch.get("meta_info") or {}).get("weight_version"))
        choices.append({**ch, "weight_version": int(v) if v.lstrip("-").isdigit() else -1})
    return parse_vllm({**resp, "choices": choices})


def get_adapter(name: str) -> Callable[[dict[str, Any]], list[Completion]]:
    """The response adapter of the backend `name` (actor.adapter), from the backends' registry."""
    return backends.resolve(backends.adapter_path(name))
