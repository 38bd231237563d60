"""One ``moelab run`` generation: the prompt's inputs (prefill in chunks), then decode steps chosen
from the logits (plain, or prompt-lookup speculative drafts verified in one batch), streamed as text;
the policy and backend built from the arguments, and the figures (speeds, first-token time, hit rate).
Also the routing of a run recorded as a trace and split into batches for the audit."""
from __future__ import annotations

import sys

from .cli_options import Fail, build_capacity, context_limit, cost_options, make_backend, read_profile, wants_gpu

__all__ = ["Generation", "generate", "run_policy", "prompt_ids", "record_trace", "batch_positions",
           "non_finite_tensor", "RunBar"]


def run_policy(args, geometry, capacity):
    from scheduler import make_policy
    from scheduler.core import CapacityError

    if args.policy == "belady":
        raise Fail("moelab run: policy 'belady' needs the future routing, which a live run does not know; "
                    "record a trace (--record-trace) and use moelab replay or simulate")
    profile = read_profile(args, geometry, "moelab run")
    options = cost_options(args, "moelab run")
    if args.miss_fraction is not None:
        if args.policy != "hybrid" or not 0.0 <= args.miss_fraction <= 1.0:
            raise Fail(f"moelab run: --miss-fraction {args.miss_fraction}: expected 0..1, with --policy hybrid")
    try:
        policy = make_policy(args.policy, geometry, capacity, profile=profile, miss_fraction=args.miss_fraction,
                             **options)
    except (ValueError, CapacityError) as exc:
        raise Fail(f"moelab run: {exc}") from None
    from .graph_gate import graph_cpu_wanted

    if graph_cpu_wanted(getattr(args, "graph_cpu", None)):  # the token graph's misses on the CPU pool
        from scheduler.graph import CpuMisses

        policy = CpuMisses(policy)
    return policy


def prompt_ids(args, tok) -> list[int]:
    text = None if args.raw else tok.chat_prompt(args.prompt)
    if text is None and not args.raw and tok.chat_template and not args.quiet:
        print("moelab run: the file's chat template has no shape moelab knows; prompt used as is", file=sys.stderr)
    ids = tok.encode(args.prompt) if text is None else tok.encode(text, special=True)
    if not ids:
        raise Fail("moelab run: the prompt encodes to no tokens")
    return ids


class Generation:
    """Inputs of the prompt (prefill, in chunks of ``chunk`` tokens), then of the decode steps,
    chosen from the model's logits when the previous batch ends; streams the text to ``out``.

    Decode: plain (one token per step), or with ``draft_len`` > 0 prompt-lookup drafts verified in
    one batch (``execute.speculative``; a step without a draft runs one token). ``batches`` holds
    each input's (tokens, phase), for the recorded trace."""

    def __init__(self, model, tok, sampler, prompt: list[int], n: int, out, chunk: int = 1, draft_len: int = 0):
        self.model, self.tok, self.sampler, self.prompt, self.n, self.out = model, tok, sampler, prompt, n, out
        self.chunk, self.draft_len = chunk, draft_len
        self.generated: list[int] = []
        self.stream = tok.stream()
        self.stopped = False
        self.batches: list[tuple[int, str]] = []
        self.decode_steps = self.drafted = self.accepted = 0
        self.weights = None

    def _emit(self, t: int) -> bool:
        """Stream ``t``; True when generation is over (an end token, or ``n`` reached)."""
        if not self.generated:
            import time

            self.first_token_at = time.perf_counter()
        self.generated.append(t)
        text = self.stream.add(t)
        if text:
            self.out.write(text)
            self.out.flush()
        if t in self.tok.stop_ids:
            self.stopped = True
        return self.stopped or len(self.generated) >= self.n

    def _input(self, index: int, pos: int, phase: str, ids: list[int], all_logits: bool = False):
        from .model import ChunkInput, TokenInput

        self.batches.append((len(ids), phase))
        if len(ids) == 1:
            return TokenInput(index, 0, pos, phase, int(ids[0]))
        return ChunkInput(index, 0, pos, phase, tuple(int(t) for t in ids), None, all_logits)

    def _logits(self, rows: bool = False):
        import numpy as np

        a = self.model.chunk_logits if rows else self.model.logits
        a = a.get() if hasattr(a, "get") else a
        if not np.isfinite(a).all():
            where = non_finite_tensor(self.weights) if self.weights is not None else None
            raise Fail(f"moelab run: the model's output after position {self.model.pos - 1} is not finite "
                        f"(NaN or Inf); " + (f"tensor {where} holds non-finite values" if where else
                                             "no dense tensor holds NaN/Inf, so a routed expert's weights may"))
        return a

    def __iter__(self):
        from .speculative import lookup_draft, verify

        index = 0
        for i in range(0, len(self.prompt), self.chunk):
            yield self._input(index, i, "prefill", self.prompt[i:i + self.chunk])
            index += 1
        if self.n <= 0 or self._emit(self.sampler(self._logits())):
            return
        pos = len(self.prompt)
        while True:
            budget = min(self.draft_len, self.n - len(self.generated) - 1)
            draft = lookup_draft(self.prompt + self.generated, budget) if budget > 0 else []
            yield self._input(index, pos, "decode", [self.generated[-1], *draft], all_logits=bool(draft))
            index += 1
            self.decode_steps += 1
            if draft:
                produced = verify(self.sampler, draft, self._logits(rows=True))
                self.drafted += len(draft)
                self.accepted += len(produced) - 1
            else:
                produced = [self.sampler(self._logits())]
            pos += len(produced)  # a rejected draft's positions are rolled back by the next input
            for t in produced:
                if self._emit(t):
                    return


class RunBar:
    """``moelab run``'s progress on stderr: a bar named ``run`` over the prompt's positions and then
    the tokens to generate. When the text streams to a terminal, the text is the decode's progress:
    the bar then covers the prompt only and is cleared before the first token is printed."""

    def __init__(self, prompt: int, tokens: int, out, quiet: bool):
        from tqdm import tqdm

        self.prompt = prompt
        self.prompt_only = out is sys.stdout and sys.stdout.isatty()
        self.bar = tqdm(total=prompt + (0 if self.prompt_only else tokens), desc="run", unit="token",
                        file=sys.stderr, disable=quiet, dynamic_ncols=True, leave=not self.prompt_only)

    def update(self, positions: int, generated: int) -> None:
        """After a batch: ``positions`` run so far (prompt included), ``generated`` tokens so far."""
        if self.prompt_only and positions >= self.prompt:
            self.bar.update(self.prompt - self.bar.n)
            self.bar.close()
            return
        self.bar.update(min(positions, self.prompt) + generated - self.bar.n)

    def close(self, generated: int | None) -> None:
        """``generated``: the tokens generated; the bar then shows 100% (an end token may have stopped
        the run short of ``tokens``). None when the run failed: the bar is cleared, so that the
        error is the one line left."""
        if generated is None:
            self.bar.leave = False
        elif not self.bar.disable and not self.prompt_only:
            self.bar.update(self.prompt + generated - self.bar.n)
            self.bar.total = self.bar.n
            self.bar.refresh()
        self.bar.close()


def non_finite_tensor(weights) -> str | None:
    """The name of the first dense tensor of ``weights`` (in file order: embedding, blocks, head)
    holding NaN or Inf, or None; read only once the output has been found non-finite."""
    import numpy as np

    from .gguf_model import StoredDense

    named = [("token_embd", weights.token_embd)]
    for l, layer in enumerate(weights.layers):
        for field, v in vars(layer).items():
            for part, arr in (v.items() if isinstance(v, dict) else [("", v)]):
                if isinstance(arr, StoredDense) or (isinstance(arr, np.ndarray) and arr.dtype.kind == "f"):
                    named.append((f"blk.{l}.{field}{'.' + part if part else ''}", arr))
    named += [("output_norm", weights.output_norm), ("output", weights.output)]
    with np.errstate(over="ignore", invalid="ignore"):
        return next((name for name, arr in named if not np.isfinite(np.asarray(arr)).all()), None)


def batch_positions(route_log: list, gen: Generation) -> list:
    """``route_log`` (one entry per position run) split into the generation's batches, for the
    audit: a multi-token batch then imports as one trace row per position."""
    out, i = [], 0
    for n, _ in gen.batches:
        out.append(route_log[i:i + n])
        i += n
    return out


def record_trace(path: str, model, gen: Generation, info, name: str) -> None:
    """The routing of every position run (rejected drafts too), one row each, with the batches
    in ``meta["batches"]`` (``execute.model.trace_batches``)."""
    import numpy as np

    from traces import Trace

    rows = model.route_log
    T, L, k = len(rows), info.num_layers, info.top_k
    ids = np.full((T, L, k), -1, np.int32)
    w = np.full((T, L, k), np.nan, np.float32)
    for t, (_, routes) in enumerate(rows):
        for layer, experts, weights in routes:
            ids[t, layer, : len(experts)] = experts
            w[t, layer, : len(weights)] = weights
    phase = np.array([int(ph == "decode") for n, ph in gen.batches for _ in range(n)], np.int8)
    pos = np.array([p for p, _ in rows], np.int32)
    meta = {"source": "moelab run", "prompt_tokens": len(gen.prompt), "prefill_chunk": gen.chunk,
            "speculative": gen.draft_len, "batches": [n for n, _ in gen.batches]}
    Trace(name, info.num_experts, k, ids, np.zeros(T, np.int32), pos, phase, w, meta).save(path)


def generate(args, weights, tok, prompt: list[int], draft_len: int, stream, record: bool = False):
    """One generation under a fresh policy, backend and model; -> (figures, generation, model, audit)."""
    import time

    from scheduler.audit import Audit

    from . import model as M
    from .sampling import Sampler

    info = weights.info
    need = len(prompt) + args.tokens + draft_len
    limit, what = context_limit(args, info)
    if need > limit:  # checked before anything is allocated
        raise Fail(f"moelab run: the prompt ({len(prompt)} tokens) and -n {args.tokens}"
                   f"{f' with --speculative {draft_len}' if draft_len else ''} need {need} positions, more than "
                   f"{what}")
    from .first_token import Phases, precompile_kernels

    ph = getattr(args, "phases", None) or Phases()
    with ph.phase("policy_s"):
        geometry = info.geometry()
        capacity = build_capacity(args, geometry, "moelab run")
        policy = run_policy(args, geometry, capacity)
    use_gpu = wants_gpu(args)
    with ph.phase("kernel_compile_s"):
        precompile_kernels(use_gpu)
    with ph.phase("backend_s"):
        backend = make_backend(args, weights, use_gpu, capacity, "moelab run")
        if hasattr(backend, "start_prepare"):  # expert weights registered and uploaded meanwhile
            backend.start_prepare(policy)
    with ph.phase("dense_upload_s"):
        model = M.MoeModel(weights, use_gpu=use_gpu, max_tokens=len(prompt) + args.tokens + draft_len)
    with ph.phase("prefill_warmup_s"):  # as llama-bench's warm-up run: first uses before the clock
        model.warm_up(min(len(prompt), args.prefill_chunk))
        attach = getattr(backend, "token_graph", None)
        if attach is not None and args.tokens > 1:
            model.token_graph = attach(model, getattr(args, "graph_cpu", None))
            if model.token_graph is not None:
                model.token_graph.prepare()
    if record:
        model.route_log = []
    if getattr(args, "router_predictor", False):
        model.router_predictor = M.RouterPredictor(info)
    audit = Audit(geometry, profile_residents=policy.cache.slot.keys(), keep_log=True, record_routes=True)
    gen = Generation(model, tok, Sampler(args.temp, args.seed, args.top_k), prompt, args.tokens, stream,
                      args.prefill_chunk, draft_len)
    gen.weights = weights  # to name a tensor with NaN/Inf when the output is not finite
    marks = {}
    bar = RunBar(len(prompt), args.tokens, stream, getattr(args, "quiet", False))

    def progress(i: int) -> None:
        if i == len(prompt):
            marks.setdefault("prefill", time.perf_counter())
        bar.update(i, len(gen.generated))

    generated = None
    try:
        res = M.run(model, backend, policy, gen, args.lag_tokens, audit, progress=progress)
        end = time.perf_counter()  # before the backend closes: its closing is neither prompt nor decode
        generated = len(gen.generated)
    finally:
        bar.close(generated)
        backend.close()
    t0 = end - res.wall_s  # the run's clock starts after the backend's preparation (kernel compile, uploads)
    gen.out.write(gen.stream.flush() + "\n")
    prefill_s = marks.get("prefill", end) - t0
    decode_tokens = max(len(gen.generated) - 1, 0)  # the first generated token comes from the prefill
    out = {"model": str(args.model), "arch": info.arch, "policy": args.policy, "prompt_tokens": len(prompt),
           "prefill_chunk": args.prefill_chunk, "prompt_s": prefill_s,
           "prompt_tokens_per_s": len(prompt) / prefill_s if prefill_s > 0 else 0.0,
           "generated": len(gen.generated), "decode_tokens": decode_tokens, "decode_s": end - t0 - prefill_s,
           "decode_steps": gen.decode_steps, "decode_positions": res.tokens - len(prompt),
           "stopped_at_eos": gen.stopped, "cache_mib": capacity.slot_bytes(geometry) / 2**20,
           "digest": audit.digest(), **audit.summary()}
    out["decode_tokens_per_s"] = decode_tokens / out["decode_s"] if decode_tokens and out["decode_s"] > 0 else 0.0
    # from the command's start (model loading, backend preparation and prefill included)
    started = getattr(args, "started_at", None)
    first = getattr(gen, "first_token_at", None)
    out["first_token_s"] = first - started if started is not None and first is not None else None
    for k, v in getattr(backend, "prepare_s", {}).items():
        ph.add(k, v)
    ph.add("prefill_s", prefill_s)
    if first is not None and "prefill" in marks:
        ph.add("first_sample_s", first - marks["prefill"])
    out["first_token_breakdown"] = ph.breakdown(out["first_token_s"])
    out["speculative"] = draft_len
    tg = model.token_graph
    out["graph_cpu"] = tg is not None and tg.cpu is not None  # misses on the CPU pool inside the token graph
    if model.router_predictor is not None:
        out["router_predictor"] = model.router_predictor.summary()
    if draft_len:
        out.update(drafted=gen.drafted, accepted=gen.accepted,
                   acceptance_rate=gen.accepted / gen.drafted if gen.drafted else 0.0,
                   tokens_per_step=decode_tokens / gen.decode_steps if gen.decode_steps else 0.0)
    return out, gen, model, audit

