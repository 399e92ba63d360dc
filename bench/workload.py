"""The load the bench sends: greedy prompts of 32-64 tokens, the same on every server, their
output lengths, and the KV pool they need."""
from __future__ import annotations

import random

from bench.options import BenchOptions
from smoke.client import Prompt

MAX_PROMPT_LEN = 64  # prompts of 32-64 tokens


def output_lengths(output_len: int, spread: float) -> tuple[int, int]:
    """The shortest and longest output length of a request (BenchOptions.output_spread)."""
    return max(1, round(output_len * (1 - spread))), max(1, round(output_len * (1 + spread)))


def window_prompt(vocab: int, concurrency: int, output_len: int, seed: int, i: int, spread: float = 0.0) -> Prompt:
    """The i-th prompt of a window's stream, with its output length: the same on every server of a
    block, another per block (seed) and level."""
    rnd = random.Random(f"{seed}-{concurrency}-{i}")
    tokens = tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, MAX_PROMPT_LEN)))
    return Prompt(f"c{concurrency}-{i}", tokens, rnd.randint(*output_lengths(output_len, spread)) if spread else output_len)


def workload(vocab: int, concurrency: int, output_len: int, seed: int, n: int, spread: float = 0.0) -> list[Prompt]:
    """The first n prompts of a window's stream."""
    return [window_prompt(vocab, concurrency, output_len, seed, i, spread) for i in range(n)]


def ramp_prompt(vocab: int, output_len: int, key: str) -> Prompt:
    """The ramp's prompt of one client's k-th request: the same on every server."""
    rnd = random.Random(key)
    return Prompt(key, tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, 64))), output_len)


def pool_tokens(opts: BenchOptions) -> int:
    """KV room for the top concurrency's running requests at their longest, a tenth to spare (the
    draft tokens of a speculative step)."""
    return int(1.1 * max(opts.concurrency) * (MAX_PROMPT_LEN + output_lengths(opts.output_len, opts.output_spread)[1]))
