"""Supervised fine-tuning data: chat / instruction records -> token ids and a loss mask.

Records are ``{"prompt": ..., "response": ...}`` or ``{"messages": [{"role", "content"}, ...]}``.
Only assistant (response) tokens and the end-of-text after them are trained on (mask 1); the
prompt, system text and role markers are context only (mask 0, label -100). A record's shape is
checked where it is read (``sources.messages_of``), with its file and line.
"""

from __future__ import annotations

from typing import Any

from layershard.train.config import ConfigError
from layershard.train.data.sources import messages_of
from layershard.train.data.tokenizer import ASSISTANT, SYSTEM, USER, TextTokenizer

_PLAIN_MARKERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}
_TOKEN_MARKERS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}


def encode_example(
    rec: Any, tok: TextTokenizer, where: str = "record"
) -> tuple[list[int], list[int]]:
    """Token ids and the 0/1 loss mask (1 where the token is a training target)."""
    if tok.eos_id is None:
        raise ConfigError(
            "--task sft needs a tokenizer with an end-of-text token; use the built-in BPE or "
            "a tokenizer whose tokenizer_config.json names eos_token"
        )
    markers = _TOKEN_MARKERS if tok.chat_tokens else _PLAIN_MARKERS
    ids: list[int] = []
    mask: list[int] = []
    for m in messages_of(rec, where):
        head = tok.encode(markers[m["role"]] + "\n")
        body = tok.encode(m["content"])
        trained = m["role"] == "assistant"
        ids += head + body
        mask += [0] * len(head) + [int(trained)] * len(body)
        if trained:  # learn to stop after an answer
            ids.append(tok.eos_id)
            mask.append(1)
        else:
            nl = tok.encode("\n")
            ids += nl
            mask += [0] * len(nl)
    return ids, mask


def pad_or_truncate(
    ids: list[int], mask: list[int], seq_len: int, pad_id: int
) -> tuple[list[int], list[int]]:
    """One example per sequence: cut to ``seq_len`` or pad (padding is never trained on)."""
    ids, mask = ids[:seq_len], mask[:seq_len]
    n_pad = seq_len - len(ids)
    return ids + [pad_id] * n_pad, mask + [0] * n_pad
