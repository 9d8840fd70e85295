"""The tokens an environment's turn adds to an episode: rendered once through the chat template, as a delta after
the model's own tokens, which are never re-rendered.

The chat template renders a conversation as text; what follows an assistant message's content is

    <end of the assistant turn><the environment's messages><the next assistant turn's header>

e.g. ChatML: `<|im_end|>\\n<|im_start|>tool\\n42<|im_end|>\\n<|im_start|>assistant\\n`. We find that text by
rendering a stand-in conversation [user, assistant <marker>] + messages and cutting at the marker (the earlier
turns of a template cannot change what follows the last assistant turn), and tokenize it with
`add_special_tokens=False` (special tokens such as <|im_end|> in the text become their ids).

The model usually ended its turn itself: its last token is the template's end of turn (<|im_end|>, <|eot_id|>),
already in the episode with its behaviour logprob. The delta then starts after it: the longest start of the
turn's closing tokens that the model's tokens end with (holding a special token) is left out. A turn cut off
(length limit, a stop string) gets the whole closing.
"""

from __future__ import annotations

from typing import Any

from inflight.engine.api.chat_template import TemplateAbilities

_MARKER = "INFLIGHT-REPLY-7f3a"  # stands for the assistant's content; plain text every template keeps as is
_STANDIN_USER = {"role": "user", "content": "hi"}


class TemplateError(ValueError):
    """The chat template cannot render an environment's turn as a delta."""


class TurnRenderer:
    """Environment messages -> the token ids that follow the model's tokens of the turn before them."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template: an episode's turns cannot be rendered")
        self.tok = tokenizer
        self.closing_text = self._after_marker([], add_generation_prompt=False)
        self.closing = self._encode(self.closing_text)
        self.specials = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
        # the template renders a request's `tools` (tools then go to the server, which renders them the same way)
        self.renders_tools = TemplateAbilities.of(tokenizer).renders_tools

    def _after_marker(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        conv = [_STANDIN_USER, {"role": "assistant", "content": _MARKER}, *messages]
        try:
            text = self.tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template may reject a role (e.g. 'tool') or a role order
            raise TemplateError(f"the chat template rejected the environment's messages: {e}") from e
        if text.count(_MARKER) != 1:
            raise TemplateError("the chat template does not render an assistant message's content verbatim")
        return text.split(_MARKER, 1)[1]

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]

    def emitted_closing(self, model_ids: list[int]) -> int:
        """How many of the turn's closing tokens the model's tokens already end with (0 when it did not end its
        turn itself). Only a match holding a special token counts: a reply that happens to end in a newline has
        not closed its turn."""
        for k in range(min(len(self.closing), len(model_ids)), 0, -1):
            part = self.closing[:k]
            if model_ids[-k:] == part and any(t in self.specials for t in part):
                return k
        return 0

    def delta(self, model_ids: list[int], messages: list[dict[str, str]]) -> list[int]:
        """The ids after `model_ids` (the model's last turn, or the episode so far): the rest of the turn's
        closing, `messages` and the header of the model's next turn."""
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise TemplateError(f"an environment message must be {{'role': str, 'content': str}}, got {m!r}")
        text = self._after_marker(messages, add_generation_prompt=True)
        if not text.startswith(self.closing_text):
            raise TemplateError("the chat template closes an assistant turn differently when messages follow it")
        rest = self._encode(text[len(self.closing_text):])
        return self.closing[self.emitted_closing(model_ids):] + rest
