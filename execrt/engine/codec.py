"""The text side of an engine for a front end (``TextCodec``) and what it reports of the model
(``ModelInfo``), as small picklable objects: a tokenizer and a chat template, or token ids as
text for a model without tokenizer.json. The engine's process builds them; a front end in
another process receives them once, at start-up, and never asks the engine for text."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from execrt.core.errors import RequestError
from execrt.engine.client import Detokenizer, ModelInfo, TextCodec

if TYPE_CHECKING:
    from execrt.engine.engine import Engine
    from execrt.models.tokenizer import ChatTemplate


def chat_prompt_ids(
    tokenizer: Any,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """The prompt ids of ``messages`` through ``template`` (``template_kwargs``: more
    variables for it, e.g. ``{"enable_thinking": False}``). ``add_generation_prompt``: end
    with the opening of the assistant's turn (the default). ``continue_final_message``: end
    inside the final message, an assistant's, right after its content, so that the answer
    continues it (assistant prefill; the template's text after it, such as its end of turn,
    is cut; exclusive with ``add_generation_prompt``). Raises RequestError naming the message
    and field that are wrong, or why the template refused them."""
    from execrt.models.tokenizer import chat_messages_problem

    problem = chat_messages_problem(messages)
    if problem is not None:
        raise RequestError(f"engine: chat: {problem}")
    final = messages[-1] if messages else {}
    if continue_final_message:
        if add_generation_prompt:
            raise RequestError(
                "engine: chat: continue_final_message and add_generation_prompt exclude each "
                "other (set add_generation_prompt false to continue the final message)"
            )
        content = final.get("content")
        if final.get("role") != "assistant" or not isinstance(content, str) or not content:
            raise RequestError(
                "engine: chat: continue_final_message needs a final assistant message with "
                f"text to continue (the final message is a {final.get('role')!r} one)"
            )
    try:
        text = template.render(
            messages, add_generation_prompt=add_generation_prompt, variables=template_kwargs
        )
    except ValueError as exc:  # raise_exception() in the template, or one of its errors
        raise RequestError(f"engine: {exc}") from None
    if continue_final_message:
        at = text.rfind(final["content"])
        if at < 0:
            raise RequestError(
                "engine: chat: continue_final_message: the template does not write the final "
                "message's content as given, so it cannot be continued"
            )
        text = text[: at + len(final["content"])]
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


class _Detokenizer(Detokenizer):
    def __init__(self, tokenizer: Any) -> None:
        from execrt.models.tokenizer import IncrementalDetokenizer

        self._inner = IncrementalDetokenizer(tokenizer)

    def push(self, token_ids: Sequence[int]) -> str:
        push = self._inner.push
        if len(token_ids) == 1:
            return push(token_ids[0])
        return "".join([push(t) for t in token_ids])

    def flush(self) -> str:
        return self._inner.flush()


class TokenizerCodec(TextCodec):
    """A model's tokenizer.json and chat template (``no_chat`` says why chat is refused when
    there is none)."""

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate | None,
        no_chat: str = "no chat template",
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._no_chat = no_chat
        self._eos_ids = tuple(eos_token_ids)
        stops = () if template is None else template.stop_token_ids(tokenizer)
        self._stops = tuple(dict.fromkeys(stops))
        self._read_bytes: Callable[[int], bytes | None] | None = None

    def __getstate__(self) -> dict[str, Any]:  # a front end in another process reads it anew
        return self.__dict__ | {"_read_bytes": None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def tokenizer_info(self) -> dict[str, Any]:
        t = self._template
        eos = t.eos_token if t is not None and t.eos_token else None
        if eos is None and self._eos_ids:  # the model's first end-of-sequence token
            eos = self._tokenizer.id_to_token(self._eos_ids[0])
        return {
            "eos_token": eos,
            "bos_token": t.bos_token if t is not None and t.bos_token else None,
            "pad_token": None,
            "chat_template": None if t is None else t.source,
        }

    def token_text(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        if self._read_bytes is None:  # the tokenizer's spelling, read on first use
            from execrt.models.tokenizer import token_bytes_reader

            self._read_bytes = token_bytes_reader(self._tokenizer)
        raw = self._read_bytes(token_id)
        return self.token_text(token_id).encode() if raw is None else raw

    def detokenizer(self) -> Detokenizer:
        return _Detokenizer(self._tokenizer)

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> tuple[list[int], tuple[int, ...]]:
        if self._template is None:
            raise ValueError(self._no_chat)
        try:
            ids = chat_prompt_ids(
                self._tokenizer, self._template, messages, template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )  # fmt: skip
        except (RequestError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        return ids, self._stops


class _IdDetokenizer(Detokenizer):
    def __init__(self) -> None:
        self._first = True

    def push(self, token_ids: Sequence[int]) -> str:
        text = " ".join(map(str, token_ids))
        if text and not self._first:
            text = " " + text
        self._first = self._first and not text
        return text

    def flush(self) -> str:
        return ""


class TokenIdCodec(TextCodec):
    """A model without tokenizer.json (random-weight benchmarks): prompts are token ids and
    the output text is the token ids, space-separated, as ``execrt generate`` prints them."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("the model has no tokenizer.json: pass the prompt as token ids")

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(map(str, token_ids))

    def token_text(self, token_id: int) -> str:
        return str(token_id)

    def detokenizer(self) -> Detokenizer:
        return _IdDetokenizer()

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> tuple[list[int], tuple[int, ...]]:
        raise ValueError("the model has no tokenizer.json, hence no chat template")


def text_codec(engine: Engine) -> TextCodec:
    """``engine``'s text side (picklable: it holds no reference to the engine)."""
    if engine.tokenizer is None:
        return TokenIdCodec()
    return TokenizerCodec(
        engine.tokenizer,
        engine.chat_template,
        no_chat_reason(engine),
        engine.model_config.eos_token_ids,
    )


def no_chat_reason(engine: Engine) -> str:
    return (
        f"engine: {engine.model_note} has no chat template "
        "(neither chat_template.jinja nor tokenizer_config.json's 'chat_template'); send it "
        "plain text instead (/v1/completions, Engine.generate(), execrt generate without --chat)"
    )


def model_info(engine: Engine, name: str | None = None) -> ModelInfo:
    """What a front end reports of ``engine``'s model; ``name`` defaults to the checkpoint's
    directory or file name."""
    return ModelInfo(
        name=name or _model_name(engine),
        context_len=engine.worker.limits.context_len,
        vocab_size=engine.model_config.vocab_size,
        has_tokenizer=engine.tokenizer is not None,
        has_chat_template=engine.chat_template is not None,
        sampling_defaults=getattr(
            engine.model_config, "sampling_defaults", ()
        ),  # (a ModelSpec: none)
        kv_slots_total=engine.limits.kv_slots_total,
    )


def _model_name(engine: Engine) -> str:
    path = engine.model_path
    if not isinstance(path, str):
        return "model"
    return os.path.basename(os.path.normpath(path)) or path
