"""Choosing the next token from logits: greedy, or seeded sampling with a temperature.

Sampling draws from ``softmax(logits / temp)`` (optionally restricted to the ``top_k`` most likely
tokens) with a ``np.random.Generator`` seeded by the caller, so a run is reproducible from its
seed. ``probs`` gives that distribution, for speculative verification (``execute.speculative``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["Sampler"]


class Sampler:
    """Next-token choice: ``temp`` 0 is greedy (ties: lower id); otherwise seeded sampling."""

    def __init__(self, temp: float = 0.0, seed: int = 0, top_k: int = 0):
        if not temp >= 0:
            raise ValueError(f"Sampler temp: {temp}, expected >= 0")
        if top_k < 0:
            raise ValueError(f"Sampler top_k: {top_k}, expected >= 0 (0: all tokens)")
        self.temp, self.top_k = float(temp), int(top_k)
        self.rng = np.random.default_rng(seed)

    def probs(self, logits) -> np.ndarray:
        """The distribution ``__call__`` draws from, over the whole vocabulary (float64; greedy:
        one-hot at the argmax)."""
        z = np.asarray(logits, dtype=np.float64).reshape(-1)
        out = np.zeros(len(z))
        if self.temp == 0.0:
            out[int(np.argmax(z))] = 1.0
            return out
        ids = np.argsort(-z, kind="stable")[: self.top_k] if self.top_k else np.arange(len(z))
        p = np.exp((z[ids] - z[ids].max()) / self.temp)
        out[ids] = p / p.sum()
        return out

    def __call__(self, logits) -> int:
        z = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.temp == 0.0:
            return int(np.argmax(z))
        ids = np.argsort(-z, kind="stable")[: self.top_k] if self.top_k else np.arange(len(z))
        p = np.exp((z[ids] - z[ids].max()) / self.temp)
        return int(ids[self.rng.choice(len(ids), p=p / p.sum())])
