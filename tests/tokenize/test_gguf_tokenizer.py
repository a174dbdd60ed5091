"""astrai's GGUF tokenizer checked against transformers' on the real SmolLM2-135M-Instruct file."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import transformers
from tiny_models import real_gguf
from tokenizers import pre_tokenizers

from astrai.tokenize import AutoTokenizer, TokenizerError

GGUF_DIR = real_gguf().parent
GGUF_NAME = real_gguf().name

# Each text on its own and all of them joined, so pieces also meet at their edges.
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Don't, won't, WE'LL; it's 5 o'clock?!",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "我们今天去公园散步，天气非常好。你好世界！日本語のテキスト",
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ 👨‍👩‍👧 café naïve Ωμέγα",
    "runs of spaces:     here  and\n\n\n\nnewlines\r\n\r\n  \t  tabs   \n   end!\n\n",
    "numbers 12345, 3.14159 and 1,000,000 (x=42; y=-7) in 2024",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|><|endoftext|>",
]
# Where transformers' GGUF tokenizer and SmolLM2 part: it has no regexes for the "smollm"
# pre-tokenizer and splits with GPT-2's, so a run of spaces or newlines before a digit loses its
# last character to the digit's piece; llama.cpp and SmolLM2's own tokenizer.json isolate digits.
SPACE_BEFORE_DIGIT_TEXTS = ["x =  3", "  42 apples", "a\n\n3", "[1,  2]"]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "system_and_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "你好 😀\n  indented"},
    ],
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(GGUF_DIR / GGUF_NAME)


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def smollm2_reference(hf_tok):
    """transformers' tokenizer with the pre-tokenizer of SmolLM2's tokenizer.json (digits
    isolated, then GPT-2's byte-level split), which is what the "smollm" name stands for."""
    reference = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return reference


@pytest.mark.parametrize("text", [*TEXTS, "".join(TEXTS)])
def test_ids_equal_transformers_gguf_tokenizer(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", [*SPACE_BEFORE_DIGIT_TEXTS, *TEXTS])
def test_digits_split_as_smollm2_tokenizer_json(tok, smollm2_reference, text):
    ids = tok.encode(text)
    assert ids == smollm2_reference(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_encode_whole_and_decode_skips_them(tok, hf_tok):
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == hf_tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == hf_tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_no_bos_added_when_the_file_says_so(tok, hf_tok):
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == hf_tok("Hello")["input_ids"]


def test_stop_and_special_ids_match_transformers(tok, hf_tok):
    assert hf_tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert hf_tok.eos_token_id in tok.stop_token_ids
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.vocab_size == len(hf_tok)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(tok, hf_tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    rendered = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    expected = hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert rendered == expected
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        == (ids["input_ids"])
    )


def test_chat_template_override():
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    tok = AutoTokenizer.from_pretrained(GGUF_DIR / GGUF_NAME, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "[user] hi\n"


@pytest.fixture(scope="module")
def smollm2_vocabulary() -> dict:
    fields = gguf.GGUFReader(GGUF_DIR / GGUF_NAME).fields
    keys = ("tokens", "token_type", "merges")
    return {key: fields[f"tokenizer.ggml.{key}"].contents() for key in keys}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_other_pre_tokenizers_split_as_transformers(tmp_path, smollm2_vocabulary, pre):
    """SmolLM2's vocabulary under another pre-tokenizer's name: the split regexes must be the
    ones transformers uses for that name (Llama 3's and Qwen2's tokenizer.json)."""
    writer = gguf.GGUFWriter(tmp_path / "renamed.gguf", "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(smollm2_vocabulary["tokens"])
    writer.add_token_types(smollm2_vocabulary["token_type"])
    writer.add_token_merges(smollm2_vocabulary["merges"])
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = AutoTokenizer.from_pretrained(tmp_path / "renamed.gguf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="renamed.gguf")
    text = "".join(TEXTS + SPACE_BEFORE_DIGIT_TEXTS)
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    # SmolLM2's vocabulary has no multi-digit tokens to tell \p{N} from \p{N}{1,3}: compare the
    # pieces the text is split into before BPE as well.
    split = tok._backend.pre_tokenizer.pre_tokenize_str
    assert split(text) == hf_tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)


def _write_gguf(path: Path, model: str, pre: str | None = "gpt2", eot: int | None = None) -> Path:
    """A GGUF file holding only a tiny tokenizer: a, b, c, the merge "a b", control tokens, and
    a [PAD7] as llama.cpp's converter pads a vocabulary to the embedding's rows."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "c", "ab", "<s>", "</s>", "<|eot|>", "[PAD7]"])
    writer.add_token_types([1, 1, 1, 1, 3, 3, 3, 5])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(4)
    writer.add_eos_token_id(5)
    writer.add_add_bos_token(True)
    if eot is not None:
        writer.add_eot_token_id(eot)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_small_file_bpe_bos_and_end_of_turn(tmp_path):
    tok = AutoTokenizer.from_pretrained(_write_gguf(tmp_path / "tiny.gguf", "gpt2", eot=6))
    assert tok.encode("abc<|eot|>") == [4, 3, 2, 6]
    assert tok.encode("abc", add_special_tokens=False) == [3, 2]
    assert tok.decode([4, 3, 2, 6]) == "abc"
    assert tok.stop_token_ids == {5, 6}


def test_a_padding_token_decodes_to_nothing(tmp_path):
    """As llama.cpp does with unused tokens, and transformers with ids it has no token for: a
    sampled padding id prints nothing, and its text is not read as it."""
    tok = AutoTokenizer.from_pretrained(_write_gguf(tmp_path / "tiny.gguf", "gpt2"))
    assert tok.decode([3, 7, 2]) == "abc"
    assert 7 not in tok.encode("[PAD7]")


def test_unknown_pre_tokenizer_names_the_known_ones(tmp_path):
    path = _write_gguf(tmp_path / "odd.gguf", "gpt2", pre="made-up")
    with pytest.raises(TokenizerError, match="'made-up'.*known:.*llama-bpe.*qwen2.*smollm"):
        AutoTokenizer.from_pretrained(path)


def test_unknown_tokenizer_model_is_refused(tmp_path):
    path = _write_gguf(tmp_path / "rwkv.gguf", "rwkv", pre=None)
    with pytest.raises(TokenizerError, match="'rwkv' tokenizer.*'gpt2'.*'llama'"):
        AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    """A Llama-2-style GGUF vocabulary: <unk>, <s>, </s>, the 256 <0xNN> byte tokens, pieces
    with U+2581 for spaces (trained on English and code) scored by rank, a control token."""
    from tokenizers import Tokenizer, models, trainers

    specials = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 300, special_tokens=specials)
    trained.train_from_iterator(TEXTS[:2] * 20, trainer)
    tokens = [*sorted(trained.get_vocab(), key=trained.get_vocab().get), "<|eot|>"]
    token_types = [2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 260), 3]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(token_types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("text", [*TEXTS, "".join(TEXTS), "  leading spaces", "<|eot|> x"])
def test_sentencepiece_ids_equal_transformers(sentencepiece_gguf, text):
    tok = AutoTokenizer.from_pretrained(sentencepiece_gguf)
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name
    )
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1  # no add_bos flag: SentencePiece adds BOS
    if text in TEXTS[:2]:  # the training texts: merged pieces, not characters or bytes
        assert len(ids) < len(text) / 2
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    if text in TEXTS:  # SentencePiece drops one leading space, and skips <|eot|>
        assert tok.decode(ids) == text
