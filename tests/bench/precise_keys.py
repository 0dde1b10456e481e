"""CPU per request of the precise prefix-cache keys: tokenizing and hashing a prompt, and
ingesting KV events (not a test, not run by the suite).

    PYTHONPATH=. .venv/bin/python -m tests.bench.precise_keys [--tokenizer tokenizer.json]

Without ``--tokenizer`` it trains the tests' small byte-level BPE (400 tokens; a real
model's 128k-token vocabulary costs more per character: pass its tokenizer.json). For 4 KB
and 32 KB prompts it prints the CPU time (process time, best of ``--repeat`` rounds) of:
tokenizing (cache miss), the cached lookup, hashing the block chain with each algorithm,
and decoding + indexing a stream of 1,000 BlockStored/BlockRemoved events. For chat
conversations of the same sizes (16 messages) it prints the cost of rendering them with the
chat template (the tests' ChatML-style one, or ``--chat-template`` / the one beside
``--tokenizer``) and of tokenizing the rendered text.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import string
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from adapters.chattemplate import JinjaChatTemplate
from adapters.hftokenizers import HFTokenizer
from adapters.kvevents.decode import decode_batch
from adapters.xxhash import xxh3_128
from domain.prefixcache.engine_hash import HASH_ALGORITHMS, EngineBlockHasher
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.prefixcache.precise import PromptKeyer
from tests.simulator.kvevents import BlockRemoved, BlockStored, EventBatch
from tests.support.tokenizer import write_tokenizer_json


def best(fn: Callable[[], object], repeat: int, number: int) -> float:
    """Lowest CPU seconds per call over ``repeat`` rounds of ``number`` calls."""
    out = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(number):
            fn()
        out = min(out, (time.process_time() - start) / number)
    return out


def words(size: int, rng: random.Random) -> str:
    parts: list[str] = []
    total = 0
    while total < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        parts.append(word)
        total += len(word) + 1
    return " ".join(parts)[:size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: the tests' small BPE)")
    parser.add_argument("--chat-template", default="", help="a Jinja chat template file")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.tokenizer or write_tokenizer_json(Path(tmp) / "tokenizer.json"))
        tokenizer = HFTokenizer.from_file(path)
        rng = random.Random(1)
        print(f"load average {os.getloadavg()[0]:.2f}; tokenizer {path.name}")
        for size in (4096, 32768):
            text = words(size, rng)
            ids = tokenizer.encode(text)
            keyer = PromptKeyer(tokenizer, EngineBlockHasher(seed="0"), block_size=args.block_size)
            keyer.tokens(text)
            tok = best(functools.partial(tokenizer.encode, text), args.repeat, 20)
            cached = best(functools.partial(keyer.tokens, text), args.repeat, 2000)
            line = (
                f"{size // 1024:>2} KB prompt, {len(ids)} tokens: tokenize {tok * 1e3:.3f} ms,"
                f" cached lookup {cached * 1e6:.1f} us"
            )
            for name in HASH_ALGORITHMS:
                hasher = EngineBlockHasher(algorithm=name, seed="0", xxh3_128=xxh3_128)
                cost = best(functools.partial(hasher.chain, ids, args.block_size), args.repeat, 20)
                line += f", hash {name} {cost * 1e3:.3f} ms"
            print(line)
        template = JinjaChatTemplate.load(path, args.chat_template)
        for size in (4096, 32768) if template is not None else ():
            assert template is not None
            messages = [
                {"role": "user" if i % 2 else "assistant", "content": words(size // 16, rng)}
                for i in range(16)
            ]
            messages[0]["role"] = "system"
            render = functools.partial(
                template.render, messages, add_generation_prompt=True, options={}
            )
            text = render()
            rendering = best(render, args.repeat, 20)
            encode = functools.partial(tokenizer.encode, text, add_special_tokens=False)
            tok = best(encode, args.repeat, 20)
            print(
                f"{size // 1024:>2} KB chat (16 messages, {len(text)} characters rendered):"
                f" render {rendering * 1e3:.3f} ms, tokenize {tok * 1e3:.3f} ms"
            )
        # event ingestion: 1,000 events as 100 batches of 10 (stored runs of 4 blocks, removals)
        payloads: list[bytes] = []
        encoder = msgspec.msgpack.Encoder()
        key = 0
        for _ in range(100):
            events: list[object] = []
            for i in range(10):
                if i % 3 == 2:
                    events.append(BlockRemoved(block_hashes=[key - 3], medium="GPU"))
                else:
                    events.append(
                        BlockStored(
                            block_hashes=[key + j for j in range(4)],
                            parent_block_hash=key - 1,
                            token_ids=list(range(4 * args.block_size)),
                            block_size=args.block_size,
                            lora_id=None,
                            medium="GPU",
                            lora_name=None,
                        )
                    )
                    key += 4
            payloads.append(encoder.encode(EventBatch(ts=time.time(), events=events)))
        index = InMemoryKVBlockIndex()

        def ingest() -> None:
            for payload in payloads:
                index.apply("e", decode_batch(payload).events)

        cost = best(ingest, args.repeat, 5)
        print(
            f"ingest 1,000 events (100 batches): {cost * 1e3:.2f} ms CPU,"
            f" i.e. {cost * 100:.2f}% of one core at 1,000 events/s"
        )


if __name__ == "__main__":
    main()
