"""Prompt-lookup speculative decoding: drafts from the context, verified in one n-token batch.

Drafting (:func:`lookup_draft`): the last ``n`` tokens of the context (prompt + generated), for
``n`` = 3, then 2, then 1, are searched for earlier in the context; the most recent earlier match's
continuation, up to ``draft_len`` tokens, is the draft. No draft model, no weights: it pays off
where the output repeats the input (code edits, quoting, summaries with names, repetitive text).

Verification (:func:`verify`): the token the model must run anyway (the last one sampled) and the
draft go through the model as one batch of ``1 + len(draft)`` tokens at consecutive positions
(``MoeModel.chunk_steps``, causal inside the batch), so row ``i`` of the batch's logits is what the
model predicts after draft token ``i``. Greedy (temperature 0): draft token ``i + 1`` is accepted
while it equals the argmax of row ``i``; the first mismatch is replaced by that argmax, and when
every draft token is accepted the last row gives one more token. The output is therefore the
token sequence plain greedy decoding produces (the batch's logits equal one-by-one decoding's up
to float32 rounding; only an argmax tie within rounding could differ). With a temperature, draft
token ``d`` (a draft with all its probability on ``d``) is accepted with probability ``p(d)``
under the sampler's distribution ``p`` of that row, else a token is drawn from ``p`` with ``d``
removed (renormalised): speculative sampling, whose output has plain sampling's distribution (not
the same draws for a seed). Rejected positions are rolled back from the KV cache by the next batch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["lookup_draft", "verify", "MAX_DRAFT"]

MAX_DRAFT = 4


def lookup_draft(context: Sequence[int], draft_len: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``draft_len`` tokens continuing the most recent earlier occurrence of the context's
    last n-gram, trying n = ``max_ngram`` down to ``min_ngram``; [] when nothing matches."""
    if draft_len < 1:
        return []
    ctx = list(context)
    n = len(ctx)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        tail = ctx[n - size:]
        first = tail[0]
        for i in range(n - size - 1, -1, -1):  # an occurrence that ends before the context does
            if ctx[i] == first and ctx[i:i + size] == tail:
                return ctx[i + size:i + size + draft_len]
    return []


def verify(sampler, draft: Sequence[int], logits: np.ndarray) -> list[int]:
    """Tokens a verification batch produces: the accepted draft tokens, then one from the model.

    ``logits`` is ``(1 + len(draft), vocab)``: row i follows the batch's token i (row 0 the token
    that was run anyway). ``sampler`` is a :class:`~execute.sampling.Sampler`; see the module
    docstring for the greedy and the sampled rule."""
    rows = np.asarray(logits)
    if rows.shape[0] != len(draft) + 1:
        raise ValueError(f"verify: {rows.shape[0]} logit rows for a draft of {len(draft)}, expected {len(draft) + 1}")
    out: list[int] = []
    for i, d in enumerate(draft):
        if sampler.temp == 0.0:
            g = sampler(rows[i])
            if g != d:
                return out + [g]
        else:
            p = sampler.probs(rows[i])
            if not sampler.rng.random() < p[d]:
                q = p.copy()
                q[d] = 0.0
                return out + [int(sampler.rng.choice(len(q), p=q / q.sum()))]
        out.append(int(d))
    return out + [sampler(rows[len(draft)])]
