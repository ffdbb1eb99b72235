"""Prompt encoding and response decoding give exactly what the tokenizer's own calls give, on the fast path or not."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

from lit_gmc.data.tokens import _exact_backend, decode_responses, encode_prompts

TEXTS = ["12+34=", "", "  spaced  out ", "Ünïcödé ½ → ∞", "<|im_start|>user\nWhat is 2+2?<|im_end|>", "a\tb\r\nc",
         "Find $\\frac{1}{2}$, then box it: \\boxed{3}."]  # fmt: skip


def byte_level_bpe(**options) -> PreTrainedTokenizerFast:
    """A small byte-level BPE with chat special tokens, as Qwen's tokenizers are built (trained here, offline)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    core.train_from_iterator(TEXTS * 20 + ["the answer is 42", "then simplify the fraction"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:], **options)  # fmt: skip


def qwen2_tokenizer() -> Qwen2Tokenizer:
    """transformers' ``Qwen2Tokenizer`` (Qwen3's) on the vocabulary and merges of :func:`byte_level_bpe`."""
    model = json.loads(byte_level_bpe().backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges, additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def word_piece_with_space_clean_up() -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer that cleans up spaces when decoding (BERT's way): decoding must take the slow path."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[SEP]": 2, "hello": 3, ",": 4, "world": 5, "!": 6, "it": 7, "'": 8, "s": 9}
    core = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)  # fmt: skip


def random_rows(tokenizer, count: int = 40, seed: int = 0) -> list[list[int]]:
    """Rows of ids as a launch holds them: any token, special ones and right padding included."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        row = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 9))]
        rows.append(row + [tokenizer.pad_token_id] * rng.randrange(0, 3))
    return rows


def assert_same_as_the_tokenizer(tokenizer) -> None:
    assert encode_prompts(tokenizer, TEXTS) == tokenizer(TEXTS, add_special_tokens=False)["input_ids"]
    rows = random_rows(tokenizer)
    assert decode_responses(tokenizer, rows) == tokenizer.batch_decode(rows, skip_special_tokens=True)


@pytest.mark.parametrize("build", ["char", "byte_level_bpe", "qwen2"])
def test_the_backend_path_is_taken_and_gives_the_tokenizer_s_ids_and_texts(build, char_tokenizer):
    tokenizer = {"char": lambda: char_tokenizer, "byte_level_bpe": byte_level_bpe, "qwen2": qwen2_tokenizer}[build]()
    assert _exact_backend(tokenizer, decoding=False) is tokenizer.backend_tokenizer
    assert _exact_backend(tokenizer, decoding=True) is tokenizer.backend_tokenizer
    assert_same_as_the_tokenizer(tokenizer)


@pytest.mark.parametrize("build", [byte_level_bpe, qwen2_tokenizer])
def test_special_tokens_in_a_prompt_are_encoded_as_such_and_skipped_when_decoded(build):
    tokenizer = build()
    (ids,) = encode_prompts(tokenizer, ["<|im_start|>hi"])
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert decode_responses(tokenizer, [ids + [tokenizer.eos_token_id]]) == ["hi"]


def test_decoding_that_cleans_up_spaces_takes_the_tokenizer_s_own_call():
    tokenizer = word_piece_with_space_clean_up()
    assert _exact_backend(tokenizer, decoding=True) is None
    rows = [[3, 4, 5, 6], [7, 8, 9, 0, 0], []]
    assert decode_responses(tokenizer, rows) == tokenizer.batch_decode(rows, skip_special_tokens=True)
    assert decode_responses(tokenizer, rows)[0] == "hello, world!"  # the clean-up happened
    assert_same_as_the_tokenizer(tokenizer)


def test_a_backend_that_truncates_or_pads_is_not_called_directly():
    tokenizer = byte_level_bpe()
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert _exact_backend(tokenizer, decoding=False) is None
    cut = [tokenizer.backend_tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert max(map(len, cut)) == 3  # the backend alone cuts the prompts; the tokenizer's call does not
    assert max(map(len, encode_prompts(tokenizer, TEXTS))) > 3
    assert encode_prompts(tokenizer, TEXTS) == tokenizer(TEXTS, add_special_tokens=False)["input_ids"]
    assert _exact_backend(tokenizer, decoding=False) is not None  # that call switched the truncation off
    tokenizer.backend_tokenizer.enable_padding(pad_id=tokenizer.pad_token_id, length=40)
    assert _exact_backend(tokenizer, decoding=False) is None
    assert_same_as_the_tokenizer(tokenizer)


def test_split_special_tokens_is_honoured():
    tokenizer = byte_level_bpe(split_special_tokens=True)
    text = ["<|im_start|>user"]
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in want[0]  # split into ordinary tokens
    assert encode_prompts(tokenizer, text) == want
    tokenizer.split_special_tokens = False
    assert _exact_backend(tokenizer, decoding=False) is None  # the backend still splits them
    assert encode_prompts(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"] != want


def test_a_tokenizer_that_is_not_a_fast_one_is_called_as_it_is():
    class Words:
        """A tokenizer of another library: only the two calls the engines use."""

        def __call__(self, texts, add_special_tokens):
            return {"input_ids": [[len(word) for word in text.split()] for text in texts]}

        def batch_decode(self, rows, skip_special_tokens):
            return [" ".join("x" * n for n in row) for row in rows]

    assert encode_prompts(Words(), ["ab c", ""]) == [[2, 1], []]
    assert decode_responses(Words(), [[2, 1], []]) == ["xx x", ""]
