"""A small BPE tokenizer trained on a task's text with the `tokenizers` library.

Digits are always single tokens (numbers stay learnable digit by digit); words (with their leading space) may merge
into one token, so the fixed instruction text of a prompt costs a few tokens instead of one per character. Every
printable ASCII character is in the vocabulary, so any ASCII text round-trips exactly; decoding is plain
concatenation. Chat format: Qwen2's `<|im_start|>role\\n...<|im_end|>\\n`; eos = `<|im_end|>`.
"""

from __future__ import annotations

import string
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOT, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, EOT, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# one digit | a word with an optional leading space | a whitespace run | any other single character
PIECES = r"\d| ?[A-Za-z]+|\s+|[^\sA-Za-z\d]"
ALPHABET = [c for c in string.printable if c not in "\x0b\x0c"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, max_length: int = 2048) -> PreTrainedTokenizerFast:
    """BPE over `texts` (merges only inside words), wrapped as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE(unk_token=EOT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=ALPHABET, min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, unk_token=EOT, bos_token=None,
        padding_side="left",  # persisted only when given to the constructor (transformers 5)
        clean_up_tokenization_spaces=False, model_max_length=max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
