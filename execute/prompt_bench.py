"""Prompt processing speed by prompt length: ``moelab run`` (in process, ``-n 1``) on prompts of
given token counts under named configurations (policy, cache size, prefill chunk, environment),
side by side in one process; each row has the run's ``prompt_tokens_per_s``, ``first_token_s``
(from the call's start, model loading included) and hit figures. ``MOELAB_PREFILL=0`` in a
configuration's environment runs the engine's grouped kernels instead of the batched path."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["Config", "WORDS", "fit_prompt", "sweep", "plot"]

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "between rivers and mountains under a pale winter sky as merchants count their silver coins "
         "and children read old stories about ships engines gardens and distant stars").split()

_FIELDS = ("prompt_tokens", "prompt_s", "prompt_tokens_per_s", "first_token_s", "prefill_chunk", "hit_rate",
           "uploads", "streams", "cpu", "upload_mib", "digest")


@dataclass(frozen=True)
class Config:
    """One configuration: a label, ``moelab run`` arguments and environment variables."""

    label: str
    argv: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.label:
            raise ValueError("Config.label: expected a non-empty name")


def fit_prompt(tokenizer, num_tokens: int, words=WORDS) -> tuple[str, int]:
    """The longest run of ``words`` (repeated) that encodes to at most ``num_tokens`` tokens, and
    its token count (a ValueError when not even one word fits)."""
    best, lo, hi = ("", 0), 1, len(words) + 2 * num_tokens
    while lo <= hi:  # token counts grow with the number of words
        mid = (lo + hi) // 2
        text = " ".join(words[i % len(words)] for i in range(mid))
        n = len(tokenizer.encode(text))
        if n <= num_tokens:
            best, lo = (text, n), mid + 1
        else:
            hi = mid - 1
    if not best[1]:
        raise ValueError(f"fit_prompt: no text of at most {num_tokens} tokens")
    return best


def sweep(model: str, lengths, configs, threads: int | None = None, repeats: int = 1, progress=None) -> list[dict]:
    """One row per (length, config, repeat): the run's figures (``_FIELDS``) with ``length`` (asked),
    ``config`` and ``repeat``. Each configuration's environment is set for its runs only."""
    from .cli_run import run_figures
    from .tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    rows = []
    for n in lengths:
        text, _ = fit_prompt(tok, int(n))
        for r in range(repeats):
            for c in configs:
                argv = [str(model), "-p", text, "--raw", "-n", "1", *c.argv]
                if threads:
                    argv += ["--threads", str(threads)]
                old = {k: os.environ.get(k) for k in c.env}
                os.environ.update({k: str(v) for k, v in c.env.items()})
                try:
                    fig, _ = run_figures(argv)
                finally:
                    for k, v in old.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                row = {"length": int(n), "config": c.label, "repeat": r, **{k: fig.get(k) for k in _FIELDS}}
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Prompt tokens/s and time to first token against prompt length, one line per configuration
    (median over repeats), log-log, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r["config"] for r in rows):
        lengths = sorted({r["length"] for r in rows if r["config"] == label})
        for ax, key in zip(axes, ("prompt_tokens_per_s", "first_token_s")):
            ys = [np.median([r[key] for r in rows if r["config"] == label and r["length"] == n]) for n in lengths]
            ax.plot(lengths, ys, marker="o", label=label)
    for ax, title in zip(axes, ("prompt tokens/s", "time to first token (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
