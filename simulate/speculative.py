"""Speculative decoding in simulation: decode rows grouped into verification batches.

Each decode step verifies ``draft_len + 1`` tokens in one batch (the token the model must produce
anyway, plus ``draft_len`` drafted ones): every MoE layer then sees one step whose experts are the
union of those rows' routes, with per-expert token counts. Drafts are accepted one by one with
probability ``acceptance`` until the first rejection, so a step produces ``1 + accepted`` tokens
and the next batch starts after them. The routing of a batch's rows is taken from the trace
(the rows the model would have produced); batches never cross a sequence boundary.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from scheduler import Step, Token

__all__ = ["verify_batches", "merge_rows"]


def merge_rows(rows: Sequence[Token], index: int) -> Token:
    """One batch of several trace rows: per layer, the union of experts (first-appearance order)
    with token counts and summed weights when every row has them."""
    layers: dict[int, dict[int, list]] = {}
    for row in rows:
        for st in row.steps:
            acc = layers.setdefault(st.layer, {})
            for i, e in enumerate(st.experts):
                c, w = acc.get(e, (0, 0.0))
                acc[e] = (c + st.count(i), None if st.weights is None or w is None else w + st.weights[i])
    steps = []
    for layer in sorted(layers):
        acc = layers[layer]
        experts = tuple(acc)
        weights = tuple(acc[e][1] for e in experts)
        steps.append(Step(layer, experts, tuple(acc[e][0] for e in experts),
                          None if any(w is None for w in weights) else weights))
    first = rows[0]
    return Token(index, first.seq, first.pos, "decode", tuple(steps), len(rows))


def verify_batches(tokens: Sequence[Token], draft_len: int, acceptance: float,
                   rng: np.random.Generator) -> tuple[list[Token], int]:
    """Group ``tokens`` (decode rows in order) into verification batches.

    Returns the batches and the number of tokens they produce. ``draft_len=0`` is plain decode.
    """
    if draft_len < 0:
        raise ValueError(f"draft_len: {draft_len}, expected >= 0")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance: {acceptance}, expected 0..1")
    rows = list(tokens)
    batches: list[Token] = []
    produced = 0
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and j - i < draft_len + 1 and rows[j].seq == rows[i].seq:
            j += 1
        drafts = j - i - 1
        accepted = 0
        while accepted < drafts and rng.random() < acceptance:
            accepted += 1
        batches.append(merge_rows(rows[i:j], len(batches)) if j - i > 1 else
                       Token(len(batches), rows[i].seq, rows[i].pos, "decode", tuple(rows[i].steps)))
        produced += 1 + accepted
        i += 1 + accepted
    return batches, produced
