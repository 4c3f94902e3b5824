"""Text <-> token ids for a model, built from a GGUF file's vocabulary or a Hugging Face model directory."""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import gguf

if TYPE_CHECKING:  # the libraries load with the first tokenizer: a node, which never tokenizes, holds neither
    import tokenizers
    from tokenizers import pre_tokenizers

# Tokens that end a turn in the chat formats of common model families; whichever exist as special
# tokens in a vocabulary stop generation along with the declared eos token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "</s>", "<|end_of_text|>")

# The replacement character the byte-level decoder emits for bytes that do not (yet) form a
# complete UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"

# GGUF token types (llama.cpp's llama_token_type) that mark tokens which must match as whole units.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@dataclass(frozen=True)
class _PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` family splits text before BPE runs."""

    # Regex applied before the byte-level mapping; None means the GPT-2 regex built into ByteLevel.
    split_regex: str | None = None
    # SmolLM (StarCoder-style) vocabularies give every digit its own token.
    individual_digits: bool = False
    # Llama 3 looks a whole pre-token up in the vocabulary before applying merges.
    ignore_merges: bool = False


_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_GPT2_PRE = _PreTokenizerSpec()
_PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    "default": _GPT2_PRE,
    "gpt2": _GPT2_PRE,
    "smollm": _PreTokenizerSpec(individual_digits=True),
    "qwen2": _PreTokenizerSpec(split_regex=_QWEN2_REGEX),
    "llama-bpe": _PreTokenizerSpec(split_regex=_LLAMA3_REGEX, ignore_merges=True),
}


def _build_pre_tokenizer(spec: _PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    import tokenizers
    from tokenizers import pre_tokenizers

    steps: list[pre_tokenizers.PreTokenizer] = []
    if spec.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split_regex is not None:
        steps.append(pre_tokenizers.Split(tokenizers.Regex(spec.split_regex), behavior="isolated"))
    # With a custom split in front, ByteLevel must only map bytes, not split again.
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split_regex is None))
    return pre_tokenizers.Sequence(steps)


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    """The python value of a GGUF metadata field, or None when the file lacks it."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _stop_ids(backend: tokenizers.Tokenizer, eos_ids: Sequence[int]) -> frozenset[int]:
    # Only special tokens count: some vocabularies (Qwen2's) also hold "</s>" as ordinary text,
    # which a model may write inside HTML without meaning to end its turn.
    special = {
        token.content: token_id
        for token_id, token in backend.get_added_tokens_decoder().items()
        if token.special
    }
    stops = set(eos_ids)
    stops.update(special[name] for name in END_OF_TURN_TOKENS if name in special)
    return frozenset(stops)


def _raise_exception(message: str) -> NoReturn:
    # Chat templates call raise_exception() to reject malformed conversations.
    raise ValueError(message)


@dataclass(frozen=True)
class Vocabulary:
    """A byte-level BPE vocabulary as GGUF stores it."""

    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values
    merges: list[str]  # "left right"
    pre: str  # pre-tokenizer name, as llama.cpp names them
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    unk_id: int | None = None
    add_bos: bool = False  # llama.cpp's default for gpt2-style vocabularies


def check_vocabulary(reader: gguf.GGUFReader) -> None:
    """Refuse what read_vocabulary would, without decoding the vocabulary."""
    model_name = _field(reader, "tokenizer.ggml.model")
    if model_name != "gpt2":
        raise ValueError(
            f"unsupported tokenizer model {model_name!r} in GGUF file: "
            "only byte-level BPE ('gpt2') tokenizers are supported"
        )
    if "tokenizer.ggml.tokens" not in reader.fields or "tokenizer.ggml.token_type" not in reader.fields:
        raise ValueError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens/token_type)")


def read_vocabulary(reader: gguf.GGUFReader) -> Vocabulary:
    check_vocabulary(reader)
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    return Vocabulary(
        tokens=tokens,
        token_types=token_types,
        merges=_field(reader, "tokenizer.ggml.merges") or [],
        pre=_field(reader, "tokenizer.ggml.pre") or "default",
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        unk_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token")),
    )


class StreamDecoder:
    """Turns ids into text one at a time, never splitting a multi-byte character across outputs."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        # Ids whose text has not been returned yet because it ends inside a UTF-8 character.
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still incomplete)."""
        self._pending.append(token_id)
        text = self._backend.decode(self._pending, skip_special_tokens=False)
        if text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The pending ids end on a character boundary, so decoding later ids on their own
        # yields exactly the text a decode of the whole sequence would.
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Return whatever is held back, incomplete characters decoded as U+FFFD."""
        if not self._pending:
            return ""
        text = self._backend.decode(self._pending, skip_special_tokens=False)
        self._pending.clear()
        return text


class Tokenizer:
    """A model's tokenizer: encoding, decoding, streaming detokenization and its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        stop_ids: frozenset[int],
        chat_template: str | None,
    ) -> None:
        if add_bos and bos_id is None:
            raise ValueError("tokenizer adds a bos token but has no bos token id")
        self._backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.stop_ids = stop_ids
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file; only byte-level BPE ("gpt2") is supported."""
        return cls.from_vocabulary(read_vocabulary(reader))

    @classmethod
    def from_vocabulary(cls, vocab: Vocabulary) -> Tokenizer:
        import tokenizers
        from tokenizers import AddedToken, decoders, models

        token_ids = {token: token_id for token_id, token in enumerate(vocab.tokens)}
        merges = [tuple(line.split(" ", 1)) for line in vocab.merges]
        pre_spec = _PRE_TOKENIZERS.get(vocab.pre, _GPT2_PRE)
        bpe = models.BPE(
            token_ids,
            merges,
            unk_token=vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None,
            byte_fallback=False,
            ignore_merges=pre_spec.ignore_merges,
        )
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _build_pre_tokenizer(pre_spec)
        backend.decoder = decoders.ByteLevel()
        special_types = (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        backend.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, token_type in zip(vocab.tokens, vocab.token_types, strict=True)
                if token_type in special_types
            ]
        )
        return cls(
            backend,
            bos_id=vocab.bos_id,
            eos_id=vocab.eos_id,
            add_bos=vocab.add_bos,
            stop_ids=_stop_ids(backend, [] if vocab.eos_id is None else [vocab.eos_id]),
            chat_template=vocab.chat_template,
        )

    @classmethod
    def from_hf_dir(cls, path: pathlib.Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory (tokenizer.json and its configs)."""
        import tokenizers

        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers package raises plain Exception for missing and malformed files
            raise ValueError(f"cannot read {path / 'tokenizer.json'}: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        bos_id = _config_token_id(backend, config.get("bos_token"))
        eos_id = _config_token_id(backend, config.get("eos_token"))
        generation_eos = generation.get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        generation_eos_ids: list[int] = generation_eos or []
        if eos_id is None and generation_eos_ids:
            eos_id = generation_eos_ids[0]

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Without the flag, tokenizer.json's post-processor is what decides whether bos is added.
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]

        eos_ids = ([] if eos_id is None else [eos_id]) + generation_eos_ids
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=bool(add_bos),
            stop_ids=_stop_ids(backend, eos_ids),
            chat_template=_hf_chat_template(path, config),
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single ids."""
        with_bos = self.add_bos if add_bos is None else add_bos
        # Special tokens are added here, not by the backend's post-processor, so that the bos
        # choice is the same whichever source the tokenizer came from.
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if not with_bos:
            return ids
        if self.bos_id is None:
            raise ValueError("cannot add a bos token: the tokenizer has none")
        return [self.bos_id, *ids]

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of one id, as stored (byte-level form, e.g. "Ġworld")."""
        text = self._backend.id_to_token(token_id)
        if text is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size} tokens")
        return text

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self._backend)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` into a prompt with the model's own chat template (and `tools`, OpenAI's function
        list, for a template that lists them itself)."""
        if self.chat_template is None:
            raise ValueError("model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The same environment settings as Hugging Face transformers, so templates render identically.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        # Hugging Face's tojson keeps the keys' order (jinja's sorts them): a function list renders as trained.
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
            eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "",
            **({"tools": tools} if tools else {}),
        )

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (a byte-level vocabulary's piece of a character included), as OpenAI's logprobs give
        them; an added token's text as UTF-8."""
        text = self.token_text(token_id)
        table = _unicode_to_byte()
        if all(c in table for c in text):
            return bytes(table[c] for c in text)
        return text.encode("utf-8")

    @property
    def tool_tags(self) -> tuple[str, str] | None:
        """The tags the chat template wraps a function call in, where it lists functions itself (Qwen's and
        Hermes' <tool_call>...</tool_call>); None where it has no tool syntax."""
        template = self.chat_template or ""
        if "tools" in template and "<tool_call>" in template and "</tool_call>" in template:
            return "<tool_call>", "</tool_call>"
        return None


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's characters back to the bytes they stand for: the printable bytes other than space stand for
    themselves, every other byte for the character 256 + its rank among them (GPT-2's scheme, which GGUF "gpt2"
    vocabularies store)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table = {chr(b): b for b in printable}
    rest = [b for b in range(256) if b not in set(printable)]
    table |= {chr(256 + i): b for i, b in enumerate(rest)}
    return table


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _config_token_id(backend: tokenizers.Tokenizer, token: str | dict[str, Any] | None) -> int | None:
    """The id of a token named in tokenizer_config.json, either as a string or a serialized AddedToken."""
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    return backend.token_to_id(token)


def _hf_chat_template(path: pathlib.Path, config: dict[str, Any]) -> str | None:
    # Newer model repositories keep the template in its own file, which takes precedence.
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one named "default" is the chat template.
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template
