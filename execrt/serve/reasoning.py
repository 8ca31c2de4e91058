"""A chat answer's reasoning apart from its content (``--reasoning-parser``), as vLLM and SGLang
return it: ``message.reasoning_content``, and ``delta.reasoning_content`` while streaming.

- ``qwen3`` (Qwen3, QwQ): an answer that begins with ``<think>`` reasons until ``</think>``;
  one that does not (thinking off) is all content.
- ``deepseek_r1`` (DeepSeek-R1 and its distillations, whose template opens ``<think>`` in the
  prompt): the answer reasons from its start until ``</think>`` (a ``<think>`` it writes
  first is dropped); without ``</think>`` it is all reasoning.

The blank lines after ``</think>`` are not content. Text that may begin a tag is held back
until it is known whether it does.
"""

from __future__ import annotations

from execrt.core.sampling_params import THINK_TAGS
from execrt.serve.text import tag_overlap

PARSERS = ("none", "qwen3", "deepseek_r1")
START, END = THINK_TAGS


def check_parser(parser: str, accepted: tuple[str, ...] = PARSERS) -> None:
    """ValueError naming ``parser`` unless it is one of ``accepted``."""
    if parser not in accepted:
        raise ValueError(f"reasoning parser {parser!r} (accepted: {', '.join(accepted)})")


class ReasoningText:
    """Splits a chat answer's text, as it arrives, into reasoning and content."""

    def __init__(self, parser: str) -> None:
        check_parser(parser, PARSERS[1:])  # "none" splits nothing: no ReasoningText
        # opening: the answer may still begin with <think>; thinking: inside the reasoning;
        # closing: after </think>, its blank lines; content: the rest.
        self._state = "opening"
        self._inside_first = parser == "deepseek_r1"
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """``(reasoning, content)`` that may be sent now."""
        self._held += piece
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            held, state = self._held, self._state
            if state == "opening":
                start = held.lstrip()
                if START.startswith(start) and len(start) < len(START):
                    return "".join(reasoning), "".join(content)  # may still be <think>
                if start.startswith(START):
                    self._held = start[len(START) :]
                    self._state = "thinking"
                else:
                    self._state = "thinking" if self._inside_first else "content"
            elif state == "thinking":
                at = held.find(END)
                if at < 0:
                    keep = tag_overlap(held, END)
                    reasoning.append(held[: len(held) - keep])
                    self._held = held[len(held) - keep :]
                    return "".join(reasoning), "".join(content)
                reasoning.append(held[:at])
                self._held = held[at + len(END) :]
                self._state = "closing"
            elif state == "closing":
                rest = held.lstrip("\n")
                if not rest:
                    self._held = ""
                    return "".join(reasoning), "".join(content)
                self._held, self._state = rest, "content"
            else:
                content.append(held)
                self._held = ""
                return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held once the answer ended: an unfinished tag is text after all."""
        held, self._held = self._held, ""
        if self._state == "thinking" or (self._state == "opening" and self._inside_first):
            return held, ""
        if self._state == "closing":
            return "", ""
        return "", held
