"""TurnRenderer: an environment's turn rendered as a delta after the model's own tokens, on real chat templates
(ChatML of the tiny model, and a Llama-3-style template whose end of turn has no newline after it)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inflight.actor.turns import TemplateError, TurnRenderer

LLAMA3_STYLE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def render(tok, messages, gen=True) -> list[int]:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
    return list(ids)


def test_chatml_delta_equals_full_rendering(tok):
    """Model's turn ended with <|im_end|> (sampled): prompt + model tokens + delta == the template's rendering of
    the whole conversation, so the next turn sees what a chat request would have rendered."""
    r = TurnRenderer(tok)
    user = [{"role": "user", "content": "What is 2+3?"}]
    prompt = render(tok, user)
    reply = "<calc>2+3</calc>"
    model = tok.encode(reply, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    env = [{"role": "tool", "content": "5"}]
    delta = r.delta(model, env)
    full = render(tok, user + [{"role": "assistant", "content": reply}] + env)
    assert prompt + model + delta == full
    assert tok.decode(delta) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert r.emitted_closing(model) == 1


def test_cut_off_turn_gets_the_whole_closing(tok):
    r = TurnRenderer(tok)
    model = tok.encode("<calc>2+3", add_special_tokens=False)  # length limit hit: no <|im_end|>
    delta = r.delta(model, [{"role": "user", "content": "go on"}])
    assert tok.decode(delta) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    # a reply that ends with a plain newline has not closed its turn
    assert r.emitted_closing(tok.encode("a\n", add_special_tokens=False)) == 0


def test_llama3_style_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_STYLE
    r = TurnRenderer(tok)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert r.closing == [eot]
    user = [{"role": "user", "content": "hi"}]
    model = tok.encode("ok", add_special_tokens=False) + [eot]
    env = [{"role": "tool", "content": "42"}]
    assert render(tok, user) + model + r.delta(model, env) == render(
        tok, user + [{"role": "assistant", "content": "ok"}] + env)


def test_bad_messages_and_templates(tok):
    r = TurnRenderer(tok)
    with pytest.raises(TemplateError, match="role"):
        r.delta([], [{"role": "tool", "content": 5}])
    with pytest.raises(TemplateError):
        r.delta([], ["not a message"])
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        TurnRenderer(tok2)
    tok2.chat_template = "{% for m in messages %}{{ raise_exception('no tools here') }}{% endfor %}"
    with pytest.raises(TemplateError, match="rejected"):
        TurnRenderer(tok2)
