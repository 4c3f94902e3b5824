"""Tests for edgerun.model.tokenizer against real GGUF vocabularies and small hand-built ones."""

from __future__ import annotations

import json
import os
import pathlib

import gguf
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from edgerun.model.tokenizer import Tokenizer

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "12345 and 6.78",
    "Crème brûlée à la façon de Zoë",
    "emoji 😀 🎉 👨‍👩‍👧 done",
    "日本語のテキストと中文",
    "def f(x):\n\treturn x + 1\n\n\nclass A:\n    pass\n",
    "   three leading spaces",
    "\n\nleading newlines and trailing spaces   ",
    "mixed: naïve café 🤖 漢字 42\r\n",
]


@pytest.fixture(scope="module")
def smollm_reader() -> gguf.GGUFReader:
    from edgerun.model.loader import default_model_path

    return gguf.GGUFReader(default_model_path())


@pytest.fixture(scope="module")
def smollm(smollm_reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_reader)


@pytest.fixture(scope="module")
def smollm_vocab(smollm_reader: gguf.GGUFReader) -> list[str]:
    return smollm_reader.fields["tokenizer.ggml.tokens"].contents()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_smollm_round_trip(smollm: Tokenizer, text: str) -> None:
    assert smollm.decode(smollm.encode(text)) == text


def test_smollm_token_text_matches_gguf_vocabulary(smollm: Tokenizer, smollm_vocab: list[str]) -> None:
    assert smollm.vocab_size == len(smollm_vocab)
    assert [smollm.token_text(i) for i in range(smollm.vocab_size)] == smollm_vocab


def test_smollm_ids_follow_gguf_vocabulary(smollm: Tokenizer, smollm_vocab: list[str]) -> None:
    assert smollm.encode("Hello") == [smollm_vocab.index("Hello")]
    assert smollm.encode(" world") == [smollm_vocab.index("Ġworld")]


def test_smollm_splits_digits_one_per_token(smollm: Tokenizer) -> None:
    ids = smollm.encode("12345")
    assert [smollm.token_text(i) for i in ids] == ["1", "2", "3", "4", "5"]


def test_smollm_special_tokens_in_text_are_single_ids(smollm: Tokenizer, smollm_vocab: list[str]) -> None:
    im_start = smollm_vocab.index("<|im_start|>")
    im_end = smollm_vocab.index("<|im_end|>")
    assert smollm.encode("<|im_start|>") == [im_start]
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start
    assert ids[-1] == im_end
    assert smollm.decode(ids, skip_special=True) == "user\nhi"


def test_smollm_bos_follows_model_setting_unless_overridden(smollm: Tokenizer) -> None:
    assert smollm.add_bos is False
    plain = smollm.encode("Hi")
    assert smollm.encode("Hi", add_bos=True) == [smollm.bos_id, *plain]


def test_smollm_token_text_rejects_unknown_id(smollm: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm.token_text(smollm.vocab_size)


def test_smollm_chat_template_adds_default_system_prompt(smollm: Tokenizer) -> None:
    prompt = smollm.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_smollm_chat_template_without_generation_prompt(smollm: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = smollm.apply_chat_template(messages, add_generation_prompt=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_smollm_stop_ids(smollm: Tokenizer, smollm_vocab: list[str]) -> None:
    assert smollm.eos_id is not None
    assert smollm.eos_id in smollm.stop_ids
    assert smollm_vocab.index("<|im_end|>") in smollm.stop_ids
    assert smollm_vocab.index("<|endoftext|>") in smollm.stop_ids


def test_smollm_stream_decoder_reproduces_decode(smollm: Tokenizer) -> None:
    text = "Sure! 😀🎉 日本語とテキスト, naïve 👨‍👩‍👧 end"
    ids = smollm.encode(text)
    decoder = smollm.stream_decoder()
    pieces = [decoder.push(token_id) for token_id in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == smollm.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # Emoji and CJK characters span several byte-level tokens, so some pushes must hold text back.
    assert "" in pieces[:-1]


def test_smollm_stream_decoder_flushes_incomplete_character(smollm: Tokenizer) -> None:
    ids = smollm.encode("😀")
    assert len(ids) > 1
    decoder = smollm.stream_decoder()
    assert [decoder.push(token_id) for token_id in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.flush().endswith("\ufffd")
    assert decoder.flush() == ""


def _byte_level_alphabet() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _write_tiny_gguf(path: pathlib.Path, *, tokenizer_model: str) -> None:
    """A GGUF holding only a small byte-level vocabulary: every byte, "hello" merges, and a few extras."""
    tokens = [*_byte_level_alphabet(), "he", "hel", "hell", "hello", "<|im_end|>", "<|endoftext|>", "</s>"]
    # "</s>" is ordinary text here, as in Qwen2's vocabulary.
    types = [1] * (len(tokens) - 3) + [3, 3, 1]
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e", "he l", "hel l", "hell o"])
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_without_optional_fields(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, tokenizer_model="gpt2")
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    vocab = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert tok.add_bos is False
    assert tok.bos_id is None
    assert tok.encode("hello") == [vocab.index("hello")]
    assert tok.encode("hello<|im_end|>") == [vocab.index("hello"), vocab.index("<|im_end|>")]
    assert tok.decode(tok.encode("hé 12 😀")) == "hé 12 😀"
    assert tok.stop_ids == {vocab.index("<|endoftext|>"), vocab.index("<|im_end|>")}
    with pytest.raises(ValueError, match="model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="cannot add a bos token"):
        tok.encode("hello", add_bos=True)


def test_gguf_unsupported_tokenizers_are_rejected_in_one_line(tmp_path: pathlib.Path) -> None:
    """A tokenizer model edgerun does not implement (BERT's WordPiece) is named with the supported ones; a
    SentencePiece vocabulary without its scores (which order the merges) is refused."""
    path = tmp_path / "wordpiece.gguf"
    _write_tiny_gguf(path, tokenizer_model="bert")
    with pytest.raises(ValueError, match=r"'bert'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))
    path = tmp_path / "sentencepiece.gguf"
    _write_tiny_gguf(path, tokenizer_model="llama")
    with pytest.raises(ValueError, match="no scores"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))


def _write_sentencepiece_gguf(path: pathlib.Path, *, space_prefix: bool) -> list[str]:
    """A small SentencePiece vocabulary: control tokens, the 256 byte pieces, and pieces whose scores order the
    merges: "▁a" + "b" scores above "a" + "b", so " ab" becomes "▁a" "b"... unless "▁ab" exists."""
    tokens = ["<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    types = [2, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "abc", "é"]
    scores = [0.0] * (5 + 256) + [-float(i) for i in range(len(pieces))]
    tokens += pieces
    types += [1] * len(pieces)
    writer = gguf.GGUFWriter(path, arch="gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


def test_sentencepiece_merges_by_score_and_falls_back_to_bytes(tmp_path: pathlib.Path) -> None:
    """SentencePiece's BPE as llama.cpp runs it: spaces as "▁", the adjacent pair whose merged piece scores highest
    first ("▁a" before "ab" before "bc": " abc" is "▁ab" "c", there being no "▁abc"), characters outside the
    vocabulary as their UTF-8 bytes' pieces, bos added, control tokens whole, and decoding back to the text; Gemma's
    chat format where the file has no template (the end of a turn stops generation)."""
    path = tmp_path / "spm.gguf"
    tokens = _write_sentencepiece_gguf(path, space_prefix=False)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    ids = {t: i for i, t in enumerate(tokens)}
    assert tok.encode(" abc") == [ids["<bos>"], ids["▁ab"], ids["c"]]
    assert tok.encode("abc", add_bos=False) == [ids["abc"]]  # "ab" first, then "ab" "c"
    assert tok.encode("bcb", add_bos=False) == [ids["bc"], ids["b"]]
    assert tok.encode("aé", add_bos=False) == [ids["a"], ids["é"]]
    assert tok.encode("ü", add_bos=False) == [ids["<0xC3>"], ids["<0xBC>"]]  # not in the vocabulary: its bytes
    assert tok.encode("<start_of_turn>a", add_bos=False) == [ids["<start_of_turn>"], ids["a"]]
    for text in (" abc", "ü a b", "c é"):
        assert tok.decode(tok.encode(text, add_bos=False)) == text
    assert tok.token_bytes(ids["▁ab"]) == b" ab" and tok.token_bytes(ids["<0xC3>"]) == b"\xc3"
    stream = tok.stream_decoder()
    assert [stream.push(i) for i in tok.encode("üa", add_bos=False)] == ["", "ü", "a"]
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief. "},
                                      {"role": "user", "content": " Hi "}])
    assert prompt == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert ids["<end_of_turn>"] in tok.stop_ids and ids["<eos>"] in tok.stop_ids
    prefixed = tmp_path / "prefixed.gguf"
    _write_sentencepiece_gguf(prefixed, space_prefix=True)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(prefixed))  # Llama 2's and Phi-3's: a space before the text
    assert tok.encode("abc", add_bos=False) == [ids["▁ab"], ids["c"]]


def _write_hf_dir(path: pathlib.Path, tokenizer_config: dict[str, object]) -> None:
    """A Hugging Face style directory with a small byte-level BPE whose post-processor adds <s>."""
    vocab = {token: token_id for token_id, token in enumerate(_byte_level_alphabet())}
    for token in ["he", "hel", "hell", "hello", "<s>", "<|eot_id|>", "<|end_of_text|>"]:
        vocab[token] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab, [("h", "e"), ("he", "l"), ("hel", "l"), ("hell", "o")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "<|eot_id|>", "<|end_of_text|>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    generation = {"eos_token_id": [vocab["<|end_of_text|>"], vocab["<|eot_id|>"]]}
    (path / "generation_config.json").write_text(json.dumps(generation))


def test_hf_dir(tmp_path: pathlib.Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "<|end_of_text|>",
        "chat_template": template,
    }
    _write_hf_dir(tmp_path, config)
    tok = Tokenizer.from_hf_dir(tmp_path)
    bos = tok.encode("<s>", add_bos=False)
    assert len(bos) == 1
    assert tok.bos_id == bos[0]
    # add_bos_token is absent, so the post-processor's <s> decides it.
    assert tok.add_bos is True
    assert tok.encode("hello") == [tok.bos_id, *tok.encode("hello", add_bos=False)]
    assert tok.token_text(tok.encode("hello", add_bos=False)[0]) == "hello"
    assert tok.token_text(tok.eos_id) == "<|end_of_text|>"
    eot = tok.encode("<|eot_id|>", add_bos=False)[0]
    assert tok.stop_ids == {tok.eos_id, eot}
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<s>user: hi<|end_of_text|>\nassistant: "
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_dir_chat_template_file_and_explicit_add_bos(tmp_path: pathlib.Path) -> None:
    _write_hf_dir(tmp_path, {"bos_token": "<s>", "add_bos_token": False, "chat_template": "unused"})
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos is False
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    # Without an eos token in tokenizer_config.json, generation_config.json supplies it.
    assert tok.token_text(tok.eos_id) == "<|end_of_text|>"


def test_qwen2_gguf() -> None:
    path = os.environ.get("EDGERUN_QWEN_GGUF")
    if not path:
        pytest.skip("set EDGERUN_QWEN_GGUF to a Qwen2 GGUF file to run this test")
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    vocab = reader.fields["tokenizer.ggml.tokens"].contents()
    tok = Tokenizer.from_gguf(reader)
    assert tok.encode("Hello world") == [vocab.index("Hello"), vocab.index("Ġworld")]
    assert [tok.token_text(i) for i in tok.encode("12345")] == ["1", "2", "3", "4", "5"]
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [vocab.index("<|im_start|>")]
    assert vocab.index("<|im_end|>") in tok.stop_ids
    # Qwen2's vocabulary holds "</s>" as ordinary text, so it must not stop generation.
    assert vocab.index("</s>") not in tok.stop_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
