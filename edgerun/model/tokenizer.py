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
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "</s>", "<|end_of_text|>",
                      "<end_of_turn>")

# The tokenizer models GGUF files name (tokenizer.ggml.model): byte-level BPE (GPT-2's, Llama 3's, Qwen's) and
# SentencePiece's BPE with byte fallback ("llama": Gemma's, Phi-3's, Llama 2's, Mistral's).
BYTE_LEVEL, SENTENCEPIECE = "gpt2", "llama"
TOKENIZER_MODELS = (BYTE_LEVEL, SENTENCEPIECE)
_TOKEN_TYPE_NORMAL = 1
# SentencePiece's word boundary: a space is written as this in the vocabulary's pieces.
_SPIECE_SPACE = "\u2581"
# A chat format for files that carry no template, by a token only that family's vocabulary holds: Gemma's turns
# (llama.cpp's built-in "gemma" format: a system message joins the first user turn, the assistant is "model", each
# message trimmed).
BUILTIN_TEMPLATES = {
    "<start_of_turn>": (
        "{% set ns = namespace(system='') %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] | trim %}"
        "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' }}"
        "{% if ns.system and role != 'model' %}{{ ns.system + '\n\n' }}{% set ns.system = '' %}{% endif %}"
        "{{ message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}

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
    """A BPE vocabulary as GGUF stores it: byte-level, or SentencePiece's."""

    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values
    merges: list[str]  # "left right"
    pre: str  # pre-tokenizer name, as llama.cpp names them
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    unk_id: int | None = None
    add_bos: bool = False  # llama.cpp's default for gpt2-style vocabularies
    model: str = BYTE_LEVEL  # tokenizer.ggml.model
    scores: list[float] | None = None  # SentencePiece: each piece's score, the higher merged first
    add_space_prefix: bool = False  # SentencePiece: a space before the text (and after each special token)


def check_vocabulary(reader: gguf.GGUFReader) -> None:
    """Refuse what read_vocabulary would, without decoding the vocabulary."""
    model_name = _field(reader, "tokenizer.ggml.model")
    if model_name not in TOKENIZER_MODELS:
        raise ValueError(
            f"unsupported tokenizer model {model_name!r} in GGUF file: byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') tokenizers are supported"
        )
    if "tokenizer.ggml.tokens" not in reader.fields or "tokenizer.ggml.token_type" not in reader.fields:
        raise ValueError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens/token_type)")
    if model_name == SENTENCEPIECE and "tokenizer.ggml.scores" not in reader.fields:
        raise ValueError("GGUF file's SentencePiece vocabulary has no scores (tokenizer.ggml.scores)")


def read_vocabulary(reader: gguf.GGUFReader) -> Vocabulary:
    check_vocabulary(reader)
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    model = _field(reader, "tokenizer.ggml.model")
    spm = model == SENTENCEPIECE
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    space_prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    template = _field(reader, "tokenizer.chat_template")
    if template is None:
        template = next((t for token, t in BUILTIN_TEMPLATES.items() if token in tokens), None)
    return Vocabulary(
        tokens=tokens,
        token_types=token_types,
        merges=_field(reader, "tokenizer.ggml.merges") or [],
        pre=_field(reader, "tokenizer.ggml.pre") or "default",
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        chat_template=template,
        unk_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        # llama.cpp's defaults where the file is silent: SentencePiece vocabularies add bos and a space prefix
        add_bos=bool(spm if add_bos is None else add_bos),
        model=model,
        scores=_field(reader, "tokenizer.ggml.scores") if spm else None,
        add_space_prefix=bool(spm if space_prefix is None else space_prefix),
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
        sentencepiece: bool = False,
    ) -> None:
        """`sentencepiece`: the vocabulary's pieces write a space as U+2581 and bytes as <0xXX> (else byte-level
        BPE's printable stand-ins for bytes)."""
        if add_bos and bos_id is None:
            raise ValueError("tokenizer adds a bos token but has no bos token id")
        self._backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.stop_ids = stop_ids
        self.chat_template = chat_template
        self.sentencepiece = sentencepiece

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file; only byte-level BPE ("gpt2") is supported."""
        return cls.from_vocabulary(read_vocabulary(reader))

    @classmethod
    def from_vocabulary(cls, vocab: Vocabulary) -> Tokenizer:
        from tokenizers import AddedToken

        backend = _sentencepiece(vocab) if vocab.model == SENTENCEPIECE else _byte_level(vocab)
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
            sentencepiece=vocab.model == SENTENCEPIECE,
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
        if self.sentencepiece:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])
            return text.replace(_SPIECE_SPACE, " ").encode("utf-8")
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


def _byte_level(vocab: Vocabulary) -> tokenizers.Tokenizer:
    """Byte-level BPE: the file's merges, its pre-tokenizer family's splits, bytes as printable stand-ins."""
    from tokenizers import decoders, models

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
    return _with(bpe, pre_tokenizer=_build_pre_tokenizer(pre_spec), decoder=decoders.ByteLevel())


def _sentencepiece(vocab: Vocabulary) -> tokenizers.Tokenizer:
    """SentencePiece's BPE as llama.cpp runs it: the whole text (spaces written as U+2581) from its characters up,
    always merging the adjacent pair whose merged piece scores highest (the leftmost among equals), and characters
    outside the vocabulary as their bytes' <0xXX> pieces. As a BPE model: every split of every normal piece into two
    normal pieces is a merge, ranked by the piece's score (then by the parts' ids)."""
    from tokenizers import decoders, models, normalizers

    assert vocab.scores is not None
    ids = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    normal = [t == _TOKEN_TYPE_NORMAL for t in vocab.token_types]
    ranked = []
    for i, piece in enumerate(vocab.tokens):
        if not normal[i] or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = ids.get(piece[:k]), ids.get(piece[k:])
            if left is not None and right is not None and normal[left] and normal[right]:
                ranked.append((-vocab.scores[i], i, left, right))
    ranked.sort()
    merges = [(vocab.tokens[left], vocab.tokens[right]) for _, _, left, right in ranked]
    bpe = models.BPE(ids, merges, unk_token=vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None,
                     byte_fallback=True, fuse_unk=True)
    steps = [normalizers.Replace(" ", _SPIECE_SPACE)]
    if vocab.add_space_prefix:  # each run of text between special tokens, as llama.cpp prefixes them
        steps.insert(0, normalizers.Prepend(" "))
    return _with(bpe, normalizer=normalizers.Sequence(steps), decoder=decoders.Sequence(
        [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]))


def _with(model: tokenizers.models.Model, **parts: object) -> tokenizers.Tokenizer:
    """A tokenizers.Tokenizer of this model with these parts (normalizer, pre_tokenizer, decoder) set."""
    import tokenizers

    backend = tokenizers.Tokenizer(model)
    for name, part in parts.items():
        setattr(backend, name, part)
    return backend


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
