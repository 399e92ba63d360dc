"""Whether a token sequence is one a grammar allows, by xgrammar (the library behind the servers'
`--grammar-backend xgrammar`) and the model's own tokenizer.

The feature matrix needs it after a tie: where the plain server's first two choices under the
grammar lie within rounding of each other, the threshold server may take the other one, and from
there on its output cannot be compared token for token with the plain server's. It must still be an
output the grammar allows."""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Grammar:
    kind: str     # "json_schema" or "regex": the sampling parameter that carries it
    source: str   # the schema (JSON text) or the regular expression, as sent
    model: str    # the checkpoint the servers load: its tokenizer, vocab size and EOS ids
    any_whitespace: bool = True  # JSON: False where the servers run --constrained-json-disable-any-whitespace


@functools.lru_cache(maxsize=4)
def _compiler(model: str) -> Any:
    """A grammar compiler for the model's tokenizer, built as the server's xgrammar backend builds
    its own: the model's vocab size and its EOS ids as the stop tokens."""
    import transformers
    import xgrammar

    config = json.loads((Path(model) / "config.json").read_text())
    eos = config.get("eos_token_id")
    stop = [eos] if isinstance(eos, int) else (list(eos) if eos else None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=int(config["vocab_size"]),
                                                   stop_token_ids=stop)
    return xgrammar.GrammarCompiler(info)


def first_break(grammar: Grammar, ids: Sequence[int]) -> str | None:
    """None if the grammar allows `ids` (a whole output or the start of one; an EOS only where the
    grammar may end), else which token it refuses."""
    import xgrammar

    compiler = _compiler(grammar.model)
    if grammar.kind == "json_schema":
        compiled = compiler.compile_json_schema(grammar.source, any_whitespace=grammar.any_whitespace)
    elif grammar.kind == "regex":
        compiled = compiler.compile_regex(grammar.source)
    else:
        raise ValueError(f"unknown grammar kind {grammar.kind!r}")
    matcher = xgrammar.GrammarMatcher(compiled)
    for k, token in enumerate(ids):
        if not matcher.accept_token(int(token)):
            where = "after the grammar's end" if matcher.is_terminated() else "there"
            return f"token {k} ({token}) is not one the grammar allows {where}"
    return None
