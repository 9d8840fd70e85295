"""The prompts of the OpenAI routes as token ids: chat messages rendered by the chat template, completion prompts
tokenized (docs/reliability.md, "Hostile input on the HTTP API").

- Big prompts are rendered and tokenized on a thread of their own, so the event loop keeps answering (/health, other
  requests' streams) while a maximal body is tokenized. Short ones, the RL hot path, stay on the event loop: a
  thread hop would add ~30 µs to the ~80 µs of tokenizing a 100-character prompt (measured).
- After a huge one, the memory its tokenizing took goes back to the system at once (glibc's malloc_trim).
- Rendered chat prompts are cached (RL asks for the same prompts again: held-out sets, retries), but only those that
  fit the context, in a cache bounded by bytes as well as entries: refused prompts are never kept.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import orjson

from inflight.engine.api import openai_api as oa
from inflight.engine.api.http_errors import BadRequest

INLINE_CHARS = 4096  # longer prompts go to the thread (tokenizing 4,096 characters takes ~3 ms)
TRIM_CHARS = 256 * 1024  # after a prompt this long, free memory goes back to the system (see _then_trim)
T = TypeVar("T")


def _malloc_trim() -> Callable[[int], Any] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


_trim = _malloc_trim()


def _then_trim(trim: bool, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), then glibc's malloc_trim: tokenizing a huge prompt allocates hundreds of MB in small pieces that
    glibc would otherwise keep (measured: RSS 400 -> 830 MB over refused 1.4 MB chats, 400 MB with it; ~16 ms)."""
    try:
        return fn(*args)
    finally:
        if trim and _trim is not None:
            _trim(0)


class RenderCache:
    """An LRU of rendered chat prompts bounded by `max_entries` and by `max_bytes` (keys plus token ids)."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 * 2**20):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[tuple, array] = OrderedDict()
        self.bytes = 0

    @staticmethod
    def _cost(key: tuple, ids: array) -> int:
        return len(key[0]) + len(key[2]) + ids.itemsize * len(ids) + 200  # + the objects' own overhead

    def get(self, key: tuple) -> list[int] | None:
        ids = self._items.get(key)
        if ids is None:
            return None
        self._items.move_to_end(key)
        return ids.tolist()

    def put(self, key: tuple, ids: list[int]) -> None:
        packed = array("q", ids)
        cost = self._cost(key, packed)
        if cost > self.max_bytes // 16 or key in self._items:  # one prompt may not push out many
            return
        self._items[key] = packed
        self.bytes += cost
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            old_key, old = self._items.popitem(last=False)
            self.bytes -= self._cost(old_key, old)

    def __len__(self) -> int:
        return len(self._items)


class Prompts:
    """Token ids of a request's prompt, for one engine (its tokenizer, vocabulary and context length)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.cache = RenderCache()
        # one thread: big prompts are tokenized one at a time (bounded CPU and memory); the tokenizer's encode
        # releases the interpreter while it runs, the template renders in pure Python with the usual switching
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-prompts")

    async def _run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, _then_trim, size >= TRIM_CHARS, fn, *args)

    # ---- chat -------------------------------------------------------------------------------------------------
    async def chat(self, req: oa.ChatCompletionRequest, opening: str) -> list[int]:
        """The messages (and tools) rendered by the chat template; `opening`: text the reply starts with."""
        try:
            msgs = [m.for_template() for m in req.messages]
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e
        tool_defs = [t.function.for_template() for t in req.tools] if req.tools else None
        try:
            key_json = orjson.dumps([msgs, tool_defs])
        except TypeError as e:  # e.g. a lone surrogate, which JSON allows and UTF-8 does not
            raise BadRequest(f"the messages could not be encoded: {e}", "messages") from e
        key = (key_json, req.add_generation_prompt, opening)
        ids = self.cache.get(key)
        if ids is None:
            ids = await self._run(len(key_json), self._render, msgs, tool_defs, req.add_generation_prompt, opening)
            if len(ids) < self.engine.max_model_len:  # fits the context: may be asked again
                self.cache.put(key, ids)
        return ids

    def _render(self, msgs: list, tools: list | None, add_generation_prompt: bool, opening: str) -> list[int]:
        engine = self.engine
        if not getattr(engine.tokenizer, "chat_template", None):
            raise BadRequest(f"model {engine.model_name!r} has no chat template, so chat messages cannot be rendered: "
                             "use /v1/completions with a prompt, or serve a chat model (or add chat_template.jinja "
                             "to the model folder)", "messages")
        try:
            ids = engine.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=False)
        except Exception as e:  # a template may raise on e.g. a role order it does not allow
            raise BadRequest(f"the chat template rejected the messages: {e}", "messages") from e
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        if opening:
            ids = [*ids, *engine.tokenizer.encode(opening, add_special_tokens=False)]
        return [int(t) for t in ids]

    # ---- completions ------------------------------------------------------------------------------------------
    async def text(self, req: oa.CompletionRequest) -> list[int]:
        p = req.single_prompt()
        if isinstance(p, str):
            return await self._run(len(p), self._encode, p)
        return await self._run(len(p), self._checked, p)

    def _checked(self, ids: list[int]) -> list[int]:
        vocab = int(getattr(self.engine, "vocab_size", len(self.engine.tokenizer)))
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids out of vocabulary (size {vocab}): {bad[:5]}", "prompt")
        return list(ids)

    def _encode(self, text: str) -> list[int]:
        try:
            return list(self.engine.tokenizer.encode(text, add_special_tokens=False))
        except Exception as e:  # e.g. lone surrogates that JSON allows but UTF-8 does not
            raise BadRequest(f"the prompt could not be tokenized: {e}", "prompt") from e

