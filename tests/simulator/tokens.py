"""The simulator's token model: prompts as sequences of pseudo-tokens.

There is no tokenizer. A text prompt counts one token per four characters (rounded up,
at least one), the ratio the endpoint picker assumes, and its *n*-th token is the text
``text[4n : 4n + 4]``. A token-id prompt is its ids. Prompt KV-cache blocks are cut from
these tokens, so two prompts sharing their first ``64 * k`` characters (with the default
16-token blocks) share their first ``k`` blocks, which is also what the picker's
approximate prefix index predicts for completions prompts.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4
"""Characters per pseudo-token of a text prompt."""


def estimate_tokens(text: str) -> int:
    """Approximate token count of ``text``: one token per four characters, at least one."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatInput:
    """What a chat template renders: the messages, ``add_generation_prompt`` and the
    request's ``chat_template_kwargs``."""

    messages: Sequence[Any]
    add_generation_prompt: bool = True
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptTokens:
    """A prompt as the engine sees it: either text (pseudo-tokens) or token ids.

    Build with :meth:`from_text` or :meth:`from_ids`.
    """

    text: str = ""
    ids: tuple[int, ...] | None = None
    chat: ChatInput | None = field(default=None, compare=False)
    """A chat request's messages: with a tokenizer that has a chat template, the engine
    renders them with it instead of using ``text``."""

    @classmethod
    def from_text(cls, text: str) -> PromptTokens:
        return cls(text=text)

    @classmethod
    def from_ids(cls, ids: tuple[int, ...]) -> PromptTokens:
        if not ids:
            raise ValueError("a token-id prompt needs at least one id")
        return cls(ids=ids)

    @property
    def num_tokens(self) -> int:
        """Number of prompt tokens (what ``usage.prompt_tokens`` reports)."""
        return len(self.ids) if self.ids is not None else estimate_tokens(self.text)

    def block_token_ids(self, block_size: int) -> Iterator[tuple[int, ...]]:
        """The token ids of every *full* block, in order (what a BlockStored event carries).

        A text prompt's pseudo-token is numbered by the CRC-32 of its four characters.
        """
        count = self.num_tokens // block_size
        if self.ids is not None:
            ids = self.ids
            for index in range(count):
                yield ids[index * block_size : (index + 1) * block_size]
        else:
            text = self.text
            step = CHARS_PER_TOKEN
            for index in range(count):
                start = index * block_size * step
                yield tuple(
                    zlib.crc32(text[offset : offset + step].encode())
                    for offset in range(start, start + block_size * step, step)
                )

    def full_blocks(self, block_size: int) -> Iterator[bytes]:
        """The content of every *full* ``block_size``-token block, in order.

        A trailing partial block is not produced: only full blocks are cacheable.
        """
        count = self.num_tokens // block_size
        if self.ids is not None:
            ids = self.ids
            for index in range(count):
                chunk = ids[index * block_size : (index + 1) * block_size]
                yield b"i" + ",".join(map(str, chunk)).encode()
        else:
            width = block_size * CHARS_PER_TOKEN
            text = self.text
            for index in range(count):
                yield b"t" + text[index * width : (index + 1) * width].encode()
