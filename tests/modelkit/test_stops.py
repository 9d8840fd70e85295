"""Which ids end a generation: the generation config's eos ids, the tokenizer's eos and the chat template's
end-of-turn token (a base model's config may name only end-of-text while its template closes turns otherwise)."""

from types import SimpleNamespace

from transformers import AutoTokenizer

from inflight.modelkit.stops import end_of_turn_id, stop_token_ids


def test_end_of_turn_token_comes_from_the_chat_template(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_turn_id(tok) == im_end
    # a "base model": config and tokenizer name only <|endoftext|>, the template still closes turns with <|im_end|>
    tok.eos_token = "<|endoftext|>"
    cfg, gen = SimpleNamespace(eos_token_id=eot), SimpleNamespace(eos_token_id=[eot])
    assert stop_token_ids(cfg, gen, tok) == {eot, im_end}
    # generation config ids all count; a missing one falls back to the model config's
    assert stop_token_ids(cfg, SimpleNamespace(eos_token_id=[eot, 7]), tok) == {eot, 7, im_end}
    assert stop_token_ids(SimpleNamespace(eos_token_id=9), SimpleNamespace(eos_token_id=None), tok) == {9, eot, im_end}
    # a template that writes plain text after the reply: no end-of-turn token, nothing guessed
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_id(tok) is None
    tok.chat_template = None
    assert end_of_turn_id(tok) is None and stop_token_ids(cfg, gen, tok) == {eot}
