"""A checkpoint's text side: tokenizer.json (or one rebuilt from GGUF metadata), its chat
template, and streaming detokenisation."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from execrt.core.errors import ModelLoadError
from execrt.core.prompts import text_problem
from execrt.models.config import read_json

logger = logging.getLogger(__name__)

#: End-of-turn markers of common chat formats; a template that writes one stops on it.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# Pre-tokenizer split patterns by ``tokenizer.ggml.pre``; others use GPT-2's byte-level regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
#: ``tokenizer.ggml.pre`` values of Llama 3's tokenizer: a word that is one vocabulary token is
#: that token whatever the merges say (tokenizer.json's ``ignore_merges``), and a file without
#: ``tokenizer.ggml.add_bos_token`` adds the bos token, as llama.cpp reads them.
_LLAMA3_PRES = frozenset({"llama3", "llama-v3", "llama-bpe"})
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
#: Written instead of tokenizer.json into a converted GGUF directory when its vocabulary
#: cannot be rebuilt: why, so each load can say so (the conversion runs only once).
NO_TOKENIZER_NOTE = "execrt-no-tokenizer.txt"
_SUPPORTED_GGUF_TOKENIZERS = "'gpt2', byte-level BPE as in Llama 3, Qwen2 and SmolLM2"
#: llama.cpp's ``tokenizer.ggml.model`` values, named for the refusal
_GGUF_TOKENIZER_KINDS = {
    "llama": "SentencePiece, as in Llama 2, Mistral and TinyLlama",
    "bert": "WordPiece",
    "t5": "Unigram",
    "rwkv": "RWKV",
}


def load_tokenizer(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` of checkpoint directory ``path``, or None without one
    (logging why when a GGUF conversion left a note)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        reason = no_tokenizer_reason(path)
        if reason is not None:
            logger.warning("%s; text prompts will be refused (pass token ids)", reason)
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ModelLoadError(f"model: {file} is not a valid tokenizer.json ({exc})") from None


def no_tokenizer_reason(path: str) -> str | None:
    """Why the converted GGUF directory ``path`` has no tokenizer.json (None: no note, e.g. a
    Hugging Face checkpoint without one)."""
    note = os.path.join(path, NO_TOKENIZER_NOTE)
    if not os.path.isfile(note):
        return None
    with open(note, encoding="utf-8") as fh:
        return fh.read().strip() or None


def missing_tokenizer_reason(path: str | None) -> str:
    """Why the checkpoint at ``path`` (a directory, a GGUF file, or None for a model built by a
    loader) has no tokenizer: the reason a GGUF conversion recorded (e.g. an unsupported
    SentencePiece vocabulary), else the missing file."""
    if path is None or path == "builtin":
        return "the model has no tokenizer"
    from execrt.models.config import checkpoint_dir

    converted = checkpoint_dir(path)
    return no_tokenizer_reason(converted) or f"{converted} has no tokenizer.json"


def chat_messages_problem(messages: object) -> str | None:
    """What is wrong with a conversation (None: nothing): it must be a non-empty list of
    mappings, each with a str ``role`` and a str ``content`` that is valid Unicode. The first
    problem names the message's index and the field."""
    shape = "a list of {'role': str, 'content': str} dicts"
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        return f"messages must be {shape}, got {type(messages).__name__}"
    if not messages:
        return "messages is empty"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"message {i} must be a dict with 'role' and 'content', got {message!r:.60}"
        for key in ("role", "content"):
            if key not in message:
                return f"message {i} has no {key!r}"
            value = message[key]
            if not isinstance(value, str):
                return (
                    f"message {i} {key!r} must be a str, got {type(value).__name__} {value!r:.60}"
                )
            problem = text_problem(value)
            if problem is not None:
                return f"message {i} {key!r}: {problem}"
    return None


def tokenizer_from_gguf(meta: dict[str, Any], file: str) -> Any:
    """A ``tokenizers`` Tokenizer from the GGUF vocabulary (byte-level BPE, ``gpt2`` model).

    Raises ModelLoadError naming the file's tokenizer model for any other (SentencePiece
    ``llama`` vocabularies of Llama 2, Mistral and TinyLlama included)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        what = f" ({_GGUF_TOKENIZER_KINDS[kind]})" if kind in _GGUF_TOKENIZER_KINDS else ""
        raise ModelLoadError(
            f"model: {file}: GGUF tokenizer model {kind!r}{what} unsupported "
            f"(supported: {_SUPPORTED_GGUF_TOKENIZERS})"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _byte_spelling()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:  # byte-level vocabularies spell every byte as one character
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    # Control (<|im_end|>, DeepSeek's <｜User｜>) and user-defined (<think>) tokens are stored as
    # their text, never byte-spelled: they keep that spelling, so they can match whole.
    types = [*types, *[1] * (len(tokens) - len(types))]
    added = (_CONTROL, _USER_DEFINED)
    vocab = {
        t if k in added else spell(t): i
        for i, (t, k) in enumerate(zip(tokens, types, strict=False))
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = meta.get("tokenizer.ggml.pre", "")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            fuse_unk=False,
            ignore_merges=pre in _LLAMA3_PRES,
        )
    )
    split = _SPLITS.get(pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Control tokens match whole and are special; user-defined ones match whole but are
    # ordinary text.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind_ in zip(tokens, types, strict=False)
        if kind_ == _CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind_ in zip(tokens, types, strict=False)
        if kind_ == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if gguf_adds_bos(meta) and bos is not None:
        tok.post_processor = TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return tok


def gguf_adds_bos(meta: dict[str, Any]) -> bool:
    """Whether a GGUF vocabulary's encodings start with its bos token: the file's
    ``tokenizer.ggml.add_bos_token``, else yes for Llama 3's tokenizer only."""
    value = meta.get("tokenizer.ggml.add_bos_token")
    return meta.get("tokenizer.ggml.pre") in _LLAMA3_PRES if value is None else bool(value)


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """Each token id's bytes as they appear in the text (None: a special token, which is
    never text); see ``token_bytes_reader``."""
    read = token_bytes_reader(tokenizer)
    return [read(i) for i in range(tokenizer.get_vocab_size(with_added_tokens=True))]


def token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes | None]:
    """A token id's bytes as they appear in the text (None: a special token, which is never
    text, or an id outside the vocabulary). Byte-level vocabularies (GPT-2's spelling: Llama
    3, Qwen2, SmolLM2) are mapped back to their bytes; SentencePiece-style ones turn
    ``<0xNN>`` into that byte and ``▁`` into a space; anything else is its UTF-8."""
    spec = json.loads(tokenizer.to_str())
    kinds = set(_types(spec.get("decoder")))
    special = {t["id"] for t in spec.get("added_tokens") or () if t.get("special")}
    spelled = {c: b for b, c in _byte_spelling().items()}

    def raw(token: str) -> bytes:
        if "ByteLevel" in kinds and all(c in spelled for c in token):
            return bytes(spelled[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        if kinds & {"Metaspace", "Replace", "ByteFallback"}:
            token = token.replace("\u2581", " ")
        return token.encode()

    def read(token_id: int) -> bytes | None:
        token = tokenizer.id_to_token(token_id) if token_id >= 0 else None
        return None if token is None or token_id in special else raw(token)

    return read


def _types(node: Any) -> Iterator[str]:
    """Every ``type`` named in a tokenizer.json component (a Sequence's parts included)."""
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            yield node["type"]
        for value in node.values():
            yield from _types(value)
    elif isinstance(node, list):
        for value in node:
            yield from _types(value)


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes stand for themselves, the others are
    moved to code points 256 and up, so every byte is one visible character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


#: The names a chat template is rendered with; ``variables`` cannot replace them.
TEMPLATE_NAMES = (
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, rendered the way transformers' ``apply_chat_template`` does."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    end_tokens: tuple[str, ...] = ()  # tokens that end the assistant's turn

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as text. ``variables`` are more names for the template to read
        (``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``); they may not replace
        the ones set here (``TEMPLATE_NAMES``)."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, indent: int | None = None) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        variables = dict(variables or {})
        taken = sorted(set(variables) & set(TEMPLATE_NAMES))
        if taken:
            raise ValueError(
                f"chat template: variable {taken[0]!r} is reserved: the renderer sets "
                f"{', '.join(TEMPLATE_NAMES)}"
            )
        try:
            return env.from_string(self.source).render(
                variables,
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template: {exc}") from None
        except Exception as exc:  # the template's own filters and operators on odd values
            raise ValueError(f"chat template: {type(exc).__name__}: {exc}") from None

    def stop_token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        ids = (tokenizer.token_to_id(t) for t in self.end_tokens)
        return tuple(i for i in ids if i is not None)


def load_chat_template(path: str) -> ChatTemplate | None:
    """The chat template of checkpoint directory ``path`` (``chat_template.jinja`` or
    ``tokenizer_config.json``'s ``chat_template``), or None when it has none."""
    config_file = os.path.join(path, "tokenizer_config.json")
    config = read_json(config_file) if os.path.isfile(config_file) else {}
    if not isinstance(config, dict):
        raise ModelLoadError(f"model: {config_file} must be a JSON object")
    jinja_file = os.path.join(path, "chat_template.jinja")
    source: Any = None
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as fh:
            source = fh.read()
    else:
        source = config.get("chat_template")
    if isinstance(source, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    bos, eos, eot = (_token_text(config.get(k)) for k in ("bos_token", "eos_token", "eot_token"))
    ends = [t for t in (eos, eot) if t] + [t for t in _END_OF_TURN if t in source]
    return ChatTemplate(source, bos, eos, tuple(dict.fromkeys(ends)))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialised AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character.

    Each new token is decoded together with the tokens since the last emitted piece (so
    decoders that look at neighbours, e.g. leading-space rules, see them); bytes of a character
    that is not complete yet decode to U+FFFD and are held back until it is.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens before this index are already emitted
        self.emitted = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def push(self, token_id: int) -> str:
        """The new text this token completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        piece = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.emitted += piece
        return piece

    def flush(self) -> str:
        """Whatever the full decode has beyond what was emitted (held-back bytes included)."""
        full = self._decode(self.ids)
        rest = full[len(self.emitted) :] if full.startswith(self.emitted) else ""
        self.emitted += rest
        return rest
