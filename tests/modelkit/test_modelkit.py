"""make-model: the trained tokenizer (round trip, chat template, persisted settings) and the saved model."""

import json
import string

import pytest
import torch

from inflight.config.tasks import TaskConfig
from inflight.modelkit import count_params, make_model
from inflight.modelkit.tokenizer import train_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(TaskConfig(), tmp_path_factory.mktemp("mk") / "tiny", size="tiny")


TEXTS = [
    "What is 17+61? Answer in \\boxed{}.",
    "652*1071: 652*1=652, 652*70=45640. 652*1071=698292\n\\boxed{698292}",
    "  odd   spacing\tand \"quotes\" ~!@#$%^&*()_+`-=[]{}|;':,./<>?",
    string.printable.replace("\x0b", "").replace("\x0c", ""),
]


def test_tokenizer_round_trip_and_digits():
    tok = train_tokenizer(["What is 12+34? Answer in \\boxed{}."] * 50, vocab_size=300)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert tok.unk_token_id not in ids
    digits = tok.convert_ids_to_tokens(tok("9876543210", add_special_tokens=False)["input_ids"])
    assert digits == list("9876543210")
    words = tok.convert_ids_to_tokens(tok("What is", add_special_tokens=False)["input_ids"])
    assert words == ["What", " is"]  # frequent words merge


def test_saved_tokenizer_is_kept_exactly(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.padding_side == "left"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("123", add_special_tokens=False)["input_ids"]) == ["1", "2", "3"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.decode(ids) == text


def test_model_loads_like_a_hub_model(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((tiny_dir / "inflight_model.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama" and not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert count_params(model) == info["parameters"]
    assert 500_000 <= info["parameters"] <= 1_000_000
    assert model.config.vocab_size == len(tok) == info["vocab_size"]
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    # same weights again through a second load, and a deterministic build for the same seed
    again = AutoModelForCausalLM.from_pretrained(tiny_dir)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    enc = tok(["What is 1+2?", "What is 10+20?"], padding=True, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, enc["input_ids"].shape[1] + 4) or tok.eos_token_id in out[:, -1].tolist()


def test_small_size_and_seeded_build(tmp_path):
    from transformers import AutoModelForCausalLM

    small = make_model(TaskConfig(), tmp_path / "small", size="small")
    n = json.loads((small / "inflight_model.json").read_text())["parameters"]
    assert 5_000_000 <= n <= 10_000_000
    a = make_model(TaskConfig(), tmp_path / "a", size="tiny", seed=3)
    b = make_model(TaskConfig(), tmp_path / "b", size="tiny", seed=3)
    wa = AutoModelForCausalLM.from_pretrained(a).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="size"):
        make_model(TaskConfig(), tmp_path / "x", size="huge")


def test_cli(tmp_path, capsys):
    from inflight.cli import main

    assert main(["make-model", "--task", "arith", str(tmp_path / "m"), "task.digits=3"]) == 0
    assert "tiny model" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "tokenizer.json").exists()


def test_other_tasks_get_a_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    out = make_model(TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", eval_size=5), tmp_path / "rg")
    tok = AutoTokenizer.from_pretrained(out)
    text = "Calculate 717 + -55 * -709.\nPut your final answer in \\boxed{}."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
