"""The simulator's token model: counts and block contents of prompts."""

from __future__ import annotations

import pytest

from tests.simulator.tokens import PromptTokens, estimate_tokens


@pytest.mark.parametrize(
    ("text", "tokens"), [("", 1), ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100)]
)
def test_text_counts_one_token_per_four_characters(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens
    assert PromptTokens.from_text(text).num_tokens == tokens


def test_token_id_prompts_count_their_ids() -> None:
    assert PromptTokens.from_ids((1, 2, 3)).num_tokens == 3
    with pytest.raises(ValueError, match="at least one id"):
        PromptTokens.from_ids(())


def test_only_full_blocks_are_produced() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(100 * 4 + 3))  # 101 tokens
    blocks = list(PromptTokens.from_text(text).full_blocks(16))
    assert len(blocks) == 6  # 96 tokens; the 5 remaining ones form no block
    assert blocks[0] == b"t" + text[:64].encode()
    assert blocks[5] == b"t" + text[320:384].encode()
    assert list(PromptTokens.from_ids(tuple(range(33))).full_blocks(16)) == [
        b"i" + ",".join(map(str, range(16))).encode(),
        b"i" + ",".join(map(str, range(16, 32))).encode(),
    ]


def test_prompts_sharing_a_prefix_share_leading_blocks() -> None:
    common = "s" * 130
    first = list(PromptTokens.from_text(common + "a" * 200).full_blocks(16))
    second = list(PromptTokens.from_text(common + "b" * 200).full_blocks(16))
    assert first[:2] == second[:2]  # 128 common characters = two 64-character blocks
    assert first[2] != second[2]


def test_text_and_token_id_blocks_never_collide() -> None:
    text_blocks = list(PromptTokens.from_text("1" * 64).full_blocks(16))
    id_blocks = list(PromptTokens.from_ids((1,) * 16).full_blocks(16))
    assert text_blocks != id_blocks
