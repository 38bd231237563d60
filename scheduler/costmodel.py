"""Per-layer costs of running experts, for policies that split misses by a cost model.

The numbers are plain seconds, given by whoever knows the hardware (the simulator's hardware
description, or a calibration on a real machine); the scheduler only compares sums of them.
``CostModel.step_s`` is a layer's time from its decision to its end for a given split, in the
order the simulator charges it (``simulate.engine``): the copy stream, the GPU stream, the CPU
pool and, with ``lane`` (a hardware file with measured executor costs), the executor's host
thread that issues them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["CostModel", "LaneCosts"]


@dataclass(frozen=True)
class LaneCosts:
    """The executor's host thread in one layer (seconds; ``scheduler.costs.HostCosts``, read from
    the hardware file's executor block), in the order ``simulate.engine`` charges it.

    With CPU experts the host submits the job (``submit_s``; the pool starts ``start_s`` later and
    pays ``pool_task_s`` + its experts) and hands the GIL over (``handoff_s``); then it queues the
    uploads (``copy_round_s`` once, ``copy_s`` each; each makes the next layer's plan
    ``plan_copy_s`` longer) and the GPU batch (``cpu_queue_s`` with CPU experts, else
    ``gpu_queue_s``, + ``expert_queue_s`` per further expert); the batch (``batch_s`` + its
    experts) runs once the copies have landed; with CPU experts the host resumes ``return_s`` after
    the pool ends and queues the rows and the combine (``combine_s``), else ``layer_combine_s``;
    the GPU's combine (``gpu_combine_s``) ends the layer. ``handoff``: one-token layers hand the
    pool's input and rows over through mapped memory instead: the pool starts ``handoff_in_s``
    after the submit, the combine waits until ``handoff_out_s`` after the pool ends, the host does
    not wait. ``one_s`` (None: none): a one-token layer of GPU experts only takes the engine's
    one-token path, ``one_s`` + ``one_scale`` x its experts' GPU time, no separate combine
    (``scheduler.costs.Costs.one_s``). ``lead_s`` (per layer; empty: 0): how long the host's part of what follows the layer
    (the next layer's planning and the issue of its dense part beyond the GPU's, or the head's)
    holds the GPU back, counted from the host's end of the layer: the layer ends for the next one
    at the later of the GPU's end and the host's end plus this lead. ``decide_s``: what the host
    adds between the next layer's dense part and its decision beyond ``CostModel.layer_s`` (the
    router read-back past the route copy, the engine's plan); read only by ``hybrid-cost``'s
    prefetch window (``scheduler.policies.prefetch``).
    """

    pool_task_s: float = 0.0
    submit_s: float = 0.0
    start_s: float = 0.0
    handoff_s: float = 0.0
    return_s: float = 0.0
    combine_s: float = 0.0
    cpu_queue_s: float = 0.0
    gpu_queue_s: float = 0.0
    expert_queue_s: float = 0.0
    copy_round_s: float = 0.0
    copy_s: float = 0.0
    plan_copy_s: float = 0.0
    layer_combine_s: float = 0.0
    batch_s: float = 0.0
    gpu_combine_s: float = 0.0
    handoff: bool = False
    handoff_in_s: float = 0.0
    handoff_out_s: float = 0.0
    lead_s: tuple[float, ...] = ()
    decide_s: float = 0.0
    one_s: float | None = None
    one_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lead_s", tuple(float(x) for x in self.lead_s))
        for name, v in vars(self).items():
            if name == "lead_s":
                if not all(x >= 0 for x in v):
                    raise ValueError("LaneCosts.lead_s: every entry must be a number >= 0")
            elif name not in ("handoff", "one_s") and not v >= 0 or name == "one_s" and v is not None and not v >= 0:
                raise ValueError(f"LaneCosts.{name}: {v}, expected a number >= 0")


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work, per layer (one entry per layer; dense layers are ignored).

    gpu: ``gpu_expert_s + work`` per expert run on the GPU, where ``work`` is
    ``tokens * gpu_token_s``, or with ``gpu_read_s`` given the roofline
    ``max(gpu_read_s, tokens * gpu_token_s)`` (weights read once, compute per token);
    pcie: ``upload_s`` per expert copied host -> device;
    cpu: likewise ``cpu_expert_s`` + ``tokens * cpu_token_s`` or ``max(cpu_read_s, tokens *
    cpu_token_s)`` per expert run on the CPU pool, whose ``cpu_task_s`` is paid once per layer
    that uses it;
    layer: ``layer_s`` of GPU work before the layer's experts (dense part, router read-back), during
    which earlier copies queued on the link keep moving (None: 0);
    ``cpu_delay_s``: in a layer that uses the CPU pool, how much later its GPU work and uploads
    are queued (an executor submits the CPU job first; 0: no delay).

    Hand-off terms (read by ``lookahead``, ``oracle`` and ``hybrid``'s share; 0: left out, as before them):
    ``cpu_copy_s``: in a layer that uses the CPU pool, the pool's result is ready this much later
    than its work (the hidden state copied to the host and the result back); ``cpu_combine_s``: GPU
    time after such a layer (the CPU result added in); ``gpu_batch_s``: fixed GPU cost of each batch
    of experts (a layer's hits are one batch, its uploaded experts another, run once they land).

    ``cpu_call_factor``: (expert count, factor) pairs: a pool call on that many experts takes the
    factor times its linear cost (the hardware file's; counts not listed: 1). ``lane``: the
    executor's host thread (``LaneCosts``); with it ``step_s`` charges the layer as the executor
    runs it and reads none of ``cpu_task_s``, ``cpu_delay_s`` and the hand-off terms, which stay
    the summaries ``lookahead``, ``oracle`` and ``guard`` price with.
    """

    gpu_expert_s: tuple[float, ...]
    gpu_token_s: tuple[float, ...]
    upload_s: tuple[float, ...]
    cpu_expert_s: tuple[float, ...]
    cpu_token_s: tuple[float, ...]
    cpu_task_s: float = 0.0
    gpu_read_s: tuple[float, ...] | None = None
    cpu_read_s: tuple[float, ...] | None = None
    layer_s: tuple[float, ...] | None = None
    cpu_delay_s: float = 0.0
    cpu_copy_s: float = 0.0
    cpu_combine_s: float = 0.0
    gpu_batch_s: float = 0.0
    cpu_call_factor: tuple[tuple[int, float], ...] = ()
    lane: LaneCosts | None = None

    def __post_init__(self) -> None:
        n = len(self.upload_s)
        names = ["gpu_expert_s", "gpu_token_s", "upload_s", "cpu_expert_s", "cpu_token_s"]
        names += [k for k in ("gpu_read_s", "cpu_read_s", "layer_s") if getattr(self, k) is not None]
        for name in names:
            v = tuple(float(x) for x in getattr(self, name))
            object.__setattr__(self, name, v)
            if len(v) != n:
                raise ValueError(f"CostModel.{name}: {len(v)} entries, expected {n} (one per layer)")
            if any(x < 0 or x != x for x in v):
                raise ValueError(f"CostModel.{name}: every entry must be a number >= 0")
        if self.cpu_task_s < 0:
            raise ValueError("CostModel.cpu_task_s: expected >= 0")
        for name in ("cpu_delay_s", "cpu_copy_s", "cpu_combine_s", "gpu_batch_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostModel.{name}: expected >= 0")
        factor = tuple((int(n), float(f)) for n, f in self.cpu_call_factor)
        if any(n < 1 or not f > 0 for n, f in factor):
            raise ValueError("CostModel.cpu_call_factor: expected (expert count >= 1, factor > 0) pairs")
        object.__setattr__(self, "cpu_call_factor", factor)
        object.__setattr__(self, "_factor", dict(factor))
        if self.lane is not None and not isinstance(self.lane, LaneCosts):
            raise ValueError("CostModel.lane: expected a LaneCosts or None")
        if self.lane is not None and self.lane.lead_s and len(self.lane.lead_s) != n:
            raise ValueError(f"CostModel.lane.lead_s: {len(self.lane.lead_s)} entries, expected {n} (one per layer)")

    def of_layers(self, layers) -> "CostModel":
        """The costs of ``layers`` only, in that order (layer ``layers[i]`` becomes layer ``i``)."""
        pick = lambda v: None if v is None else tuple(v[l] for l in layers)
        lane = self.lane if self.lane is None or not self.lane.lead_s else replace(self.lane,
                                                                                  lead_s=pick(self.lane.lead_s))
        return CostModel(pick(self.gpu_expert_s), pick(self.gpu_token_s), pick(self.upload_s),
                         pick(self.cpu_expert_s), pick(self.cpu_token_s), self.cpu_task_s,
                         pick(self.gpu_read_s), pick(self.cpu_read_s), pick(self.layer_s), self.cpu_delay_s,
                         self.cpu_copy_s, self.cpu_combine_s, self.gpu_batch_s, self.cpu_call_factor, lane)

    def gpu_s(self, layer: int, tokens: int) -> float:
        work = tokens * self.gpu_token_s[layer]
        if self.gpu_read_s is not None:
            work = max(self.gpu_read_s[layer], work)
        return self.gpu_expert_s[layer] + work

    def cpu_s(self, layer: int, tokens: int) -> float:
        work = tokens * self.cpu_token_s[layer]
        if self.cpu_read_s is not None:
            work = max(self.cpu_read_s[layer], work)
        return self.cpu_expert_s[layer] + work


    def decode_key(self, layer: int) -> tuple[float, ...]:
        """What ``step_s`` reads of ``layer`` for one-token experts: layers with equal keys decide
        decode steps alike (policies share their memos between them)."""
        lead = self.lane.lead_s[layer] if self.lane is not None and self.lane.lead_s else 0.0
        return self.gpu_s(layer, 1), self.cpu_s(layer, 1), self.upload_s[layer], lead

    def pool_s(self, work_s: float, num_experts: int) -> float:
        """The pool's time for one call on ``num_experts`` experts whose own times sum to
        ``work_s``: its task cost, then the work, times ``cpu_call_factor`` for that count (0:
        no call)."""
        if not num_experts:
            return 0.0
        t = (self.lane.pool_task_s if self.lane is not None else self.cpu_task_s) + work_s
        f = self._factor.get(num_experts)
        return t if f is None else t * f

    def step_s(self, layer: int, hits_s: float, num_hits: int, up_s: float, num_up: int, pool_s: float,
               queued_s: float = 0.0, one_token: bool = True) -> tuple[float, float]:
        """A layer's time from its decision to its end, and the link work still queued then.

        ``hits_s``/``up_s``: GPU seconds of the ``num_hits`` resident and ``num_up`` uploaded
        experts (``gpu_s`` each); ``pool_s``: the pool's call (``pool_s``; 0: no CPU expert);
        ``queued_s``: copies already on the link at the decision (uploads queue behind them);
        ``one_token``: a decode step (the mapped-memory hand-off applies only to those).

        Without ``lane`` (``simulate.engine``'s charge without executor costs): the hits run as a
        batch (``gpu_batch_s``) from the decision, the uploads one by one on the link and then as
        a batch; the pool's call with ``cpu_copy_s`` runs beside them, then ``cpu_combine_s``;
        with the pool in use, GPU work and copies start ``cpu_delay_s`` late. With ``lane``: see
        ``LaneCosts``; all GPU experts are one batch after the copies.
        """
        ln = self.lane
        if ln is None:
            d = self.cpu_delay_s if pool_s else 0.0
            g = d + self.gpu_batch_s + hits_s if num_hits else d
            link = 0.0
            if num_up:
                link = (queued_s if queued_s > d else d) + num_up * self.upload_s[layer]
                g = (g if g > link else link) + self.gpu_batch_s + up_s
            if pool_s:
                c = self.cpu_copy_s + pool_s
                g = (g if g > c else c) + self.cpu_combine_s
            return g, (0.0 if num_up or queued_s <= g else queued_s - g)
        n_gpu = num_hits + num_up
        hand = one_token and ln.handoff and pool_s > 0.0
        h = g = p_end = 0.0
        if pool_s:
            h = ln.submit_s
            if hand:
                g, p_end = h, h + ln.handoff_in_s + pool_s
            else:
                p_end = h + ln.start_s + pool_s
                h += ln.handoff_s
        link = 0.0
        if num_up:
            link = (queued_s if queued_s > h else h) + num_up * self.upload_s[layer]
            h += ln.copy_round_s + num_up * ln.copy_s
        one = one_token and n_gpu and not pool_s and ln.one_s is not None
        if n_gpu:
            h += (ln.cpu_queue_s if pool_s else ln.gpu_queue_s) + (n_gpu - 1) * ln.expert_queue_s
            g = max(g, h, link) + (ln.one_s + ln.one_scale * (hits_s + up_s) if one else ln.batch_s + hits_s + up_s)
        if hand:
            g = max(g, p_end + ln.handoff_out_s)
        elif pool_s:
            h = max(h, p_end + ln.return_s) + ln.combine_s
            g = g if g > h else h
        else:
            h += ln.layer_combine_s
        g += 0.0 if one else ln.gpu_combine_s
        h += ln.lead_s[layer] if ln.lead_s else 0.0
        end = (g if g > h else h) + num_up * ln.plan_copy_s  # the next layer plans around these copies
        return end, (0.0 if num_up or queued_s <= end else queued_s - end)
