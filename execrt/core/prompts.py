"""What a ``generate()`` call accepts as prompts and sampling parameters: splitting, token ids."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from typing import Any

from execrt.core.schedule import SamplingParams

_PROMPT_KINDS = "text, a sequence of int token ids or a 1-D integer array / tensor"


def _is_array(value: object) -> bool:
    """A numpy array or torch tensor (duck-typed: the core does not import numpy)."""
    return not isinstance(value, (str, bytes)) and all(
        hasattr(value, a) for a in ("ndim", "dtype", "tolist")
    )


def _is_token_id(value: object) -> bool:
    # numbers.Integral covers Python and numpy integers; bool is never a token id.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def split_prompts(prompts: object) -> tuple[list[object], bool]:
    """The prompts of one ``generate()`` call and whether it was a single prompt.

    Text, a sequence whose first item is an integer (numpy integers count) and any array or
    tensor are one prompt; another sequence is a list of prompts. Anything else is one prompt
    too, so that ``prompt_token_ids`` reports it once rather than once per element.
    """
    if isinstance(prompts, (str, bytes)) or _is_array(prompts):
        return [prompts], True
    if isinstance(prompts, Sequence):
        first = prompts[0] if len(prompts) else None
        if _is_token_id(first) or isinstance(first, bool):
            return [prompts], True
        return list(prompts), False
    return [prompts], True


def prompt_token_ids(prompt: object) -> tuple[list[int], str | None]:
    """The token ids of a prompt that is not text, or ([], the problem): one message per
    prompt naming its type. Accepts a sequence of ints (numpy integers count, bools do not)
    and a 1-D integer numpy array or torch tensor (any device)."""
    if _is_array(prompt):
        array: Any = prompt
        kind = f"{array.ndim}-D {type(array).__name__} of {array.dtype}"
        if array.ndim != 1:
            return [], f"prompt must be {_PROMPT_KINDS}, got a {kind}"
        items = list(array.tolist())
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
        kind, items = type(prompt).__name__, list(prompt)
    else:
        return [], f"prompt must be {_PROMPT_KINDS}, got {type(prompt).__name__}"
    if set(map(type, items)) <= {int}:  # the common case, at C speed: plain ints
        return items, None
    bad = [t for t in items if not _is_token_id(t)]
    if bad:
        return [], (
            f"prompt must be {_PROMPT_KINDS}, got a {kind} holding "
            f"{type(bad[0]).__name__} {bad[0]!r}"
        )
    return [operator.index(t) for t in items], None


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be tokenized (None: it can): a lone surrogate, which no encoding
    can write. Names the first one's position; one that stands for an undecodable byte
    (Python's ``surrogateescape``, as in command-line arguments) names the byte."""
    for i, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            what = f"the lone surrogate {char!r}"
            if "\udc80" <= char <= "\udcff":
                what = f"byte 0x{ord(char) - 0xDC00:02x}, which is not UTF-8"
            return f"text is not valid Unicode: character {i} is {what}"
    return None


def broadcast_sampling_params(sampling_params: object, n: int) -> list[Any]:
    """One entry per prompt: None -> defaults; a list or tuple is per prompt (its length
    must be ``n``: ValueError); anything else, a SamplingParams or not, is shared by all, so
    a wrong type (a dict, say) is reported per request with its own type name. Entries are
    not checked here (hence ``Any``): the caller validates each before using it."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if not isinstance(sampling_params, (list, tuple)):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ValueError(f"engine: {len(sampling_params)} sampling_params for {n} prompts")
    return list(sampling_params)
