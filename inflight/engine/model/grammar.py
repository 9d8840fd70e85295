"""Grammar-constrained decoding (structured outputs), with xgrammar: what a constrained sequence may sample next.

A request's constraint is a `GrammarSpec` (SamplingParams.structured): a JSON schema, any JSON object, a regex, a
choice of strings, an EBNF / Lark grammar, or an xgrammar structural tag (the API builds tool calls as one,
api/structured.py). `Grammars` compiles a spec once per engine (compiled grammars are cached by spec) against the
engine's tokenizer; each constrained sequence keeps its own matcher (the grammar's state after its tokens so far).

Each step, before sampling, `mask_logits` sets the logits of the tokens the grammar does not allow next to -inf on
the constrained rows only (the other rows of the batch are left as they are), so the sampler draws from, and reports
the logprob of, the masked (then temperature-scaled, top-k / top-p filtered) distribution. After sampling, `advance`
feeds the token to the matcher; the sequence ends ("stop") once the grammar is complete and has taken its stop
token (the engine's EOS ids: the only tokens a complete grammar allows). A grammar that the vocabulary cannot
continue (a dead end: no token allowed, e.g. a character the tokenizer lacks) allows the stop tokens, and ends there.

Why xgrammar (over llguidance): it is vLLM's and SGLang's default backend; on CPU (one thread) it fills the mask for
SmolLM2's 49k vocabulary in 3 µs median / 7 µs mean per token of a JSON schema (llguidance 1.9: 26 / 181 µs), and it
reads the tests' character-level tokenizer, which llguidance's tokenizer import refuses. Its own CPU
`apply_token_bitmask_inplace` takes ~250 µs a row when few tokens are allowed; unpacking the bits with numpy and one
masked_fill takes ~50 µs, so that is what `mask_logits` does.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[22:48:09] /project/cpp/x.cc:94: " before a message
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained request's output must match. `value`: the JSON schema as JSON text (json_schema), the
    regex, the choices as a JSON list of strings (choice), the EBNF or Lark grammar, the structural tag as JSON
    text; "" for json_object (any JSON object)."""

    kind: Kind
    value: str = ""


def _choice_ebnf(value: str) -> str:
    """An EBNF grammar whose strings are exactly the choices (a JSON list of non-empty strings)."""
    try:
        choices = json.loads(value)
    except ValueError as e:
        raise ValueError(f"choice must be a list of strings ({e})") from e
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """Compiles specs against one tokenizer (thread-safe: the server compiles on a worker thread, the engine may too),
    keeps the last `max_cached` compiled grammars, and makes matchers. `stop_ids`: the tokens that end a complete
    grammar (the engine's EOS ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int], max_cached: int = 256):
        import xgrammar as xgr  # lazy: 0.3 s to import, and only constrained requests need it

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # cached here, by spec
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self.compiles = 0  # how many specs were compiled (not found in the cache)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (an xgrammar CompiledGrammar); ValueError naming the problem for a schema,
        regex or grammar that is not valid."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self.compiles += 1
            self._cache[spec] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        c, kind = self._compiler, spec.kind
        if kind not in KINDS:
            raise ValueError(f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")
        what = {"json_schema": "JSON schema", "structural_tag": "structural tag"}.get(kind, kind)
        try:
            if kind == "json_object":  # an object, as OpenAI's json_object means (any keys: strict_mode off)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "json_schema":
                schema = json.loads(spec.value)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema is an object (or a boolean)")
                return c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return c.compile_regex(spec.value)
            if kind == "choice":
                return c.compile_grammar(_choice_ebnf(spec.value))
            if kind == "structural_tag":
                return c.compile_structural_tag(spec.value)
            if "::=" in spec.value:  # EBNF (GBNF, as llama.cpp and xgrammar write it); else Lark, as vLLM accepts
                return c.compile_grammar(spec.value)
            return c.compile_lark(spec.value)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own errors; all are bad input
            lines = str(e).strip().splitlines()
            msg = _LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__
            raise ValueError(f"invalid {what}: {msg}") from e

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher of a compiled grammar: one per sequence."""
        return self._xgr.GrammarMatcher(compiled)

    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Sets, in place, the logits of the tokens that matchers[i] does not allow next to -inf in row rows[i]
        of `logits` [B, V] (its other rows untouched)."""
        V = logits.shape[1]
        assert V == self.vocab_size, f"logits of {V} tokens, grammars of {self.vocab_size}"
        bitmask = torch.empty(len(rows), (V + 31) // 32, dtype=torch.int32)
        need = [bool(m.fill_next_token_bitmask(bitmask, i)) for i, m in enumerate(matchers)]
        keep = [i for i, n in enumerate(need) if n]  # False: every token allowed, nothing to mask
        if not keep:
            return
        bits = np.unpackbits(bitmask[keep].numpy().view(np.uint8), axis=1, bitorder="little")[:, :V].view(np.bool_)
        dead = ~bits.any(axis=1)
        if dead.any():  # the vocabulary cannot continue the grammar: end with a stop token
            stops = np.array([t for t in self.stop_ids if t < V], dtype=np.int64)
            bits[np.ix_(np.flatnonzero(dead), stops)] = True
        allowed = torch.from_numpy(bits).to(logits.device, non_blocking=True)
        idx = torch.tensor([rows[i] for i in keep], device=logits.device)
        with torch.inference_mode():  # the forward's logits are inference tensors: in place only in this mode
            logits[idx] = logits[idx].masked_fill_(~allowed, float("-inf"))


def advance(matcher: Any, token: int) -> bool:
    """Feeds the sampled token to the sequence's matcher; True when the sequence ends with it (the grammar is
    complete and took its stop token, or it was at a dead end)."""
    return not matcher.accept_token(token) or bool(matcher.is_terminated())
