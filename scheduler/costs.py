"""Per-layer resource times, computed arithmetically from a model and a hardware description.

Everything the simulator charges is here, so the timing model reads in one place:

- GPU dense work of a layer: ``dense_kernels`` kernels (``launch_s`` each from Python, or
  ``graph_kernel_s`` in a captured graph: ``ExecConfig.engine``) + (dense weights + KV cache at the
  current context) / GPU bandwidth; multi-token batches use the roofline max(bytes/bw, flops/peak).
- A GPU expert: its bytes / GPU bandwidth (roofline with token count), plus ``expert_kernels``
  launches per batch of experts.
- An upload (on-demand, stream or background): ``copy_latency_s`` + bytes / link bandwidth.
- CPU experts of a layer: one parallel call (``Costs.cpu_call_s``), ``cpu_task_s`` + bytes / pool
  rate (roofline: the pool reads the weights once at ``cpu_mem_gbps`` and computes each token at the
  thread rate), times the hardware file's ``cpu_call_factor`` for that expert count where it has
  one, with the hidden state copied to the host and the result back (latency + bytes each).
- A promotion: a device-to-device copy (read + write at GPU bandwidth).
- Per token: the output head (bytes / GPU bandwidth) and the sampled token's readback latency.
- Per layer, by engine: the route read back (``copy_latency_s``, moelab), one graph-split round
  trip (``split_sync_s``, llama.cpp, where the host takes part), or a mailbox hand-off each way
  (``mailbox_s``, the seed's hybrid).

When the hardware file has ``executor`` costs (measured by ``moelab calibrate``), ``Costs.host``
holds the host lane's costs (:class:`HostCosts`) and the GPU's fixed costs come from the same
measurements instead of ``launch_s`` counts; the engine then charges the host thread too.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .hardware import Hardware
from .models import ModelSpec

__all__ = ["ExecConfig", "Costs", "HostCosts", "DEFAULT_MODEL", "DEFAULT_HARDWARE", "ENGINES"]

ENGINES = ("moelab", "llama.cpp", "mailbox")  # see ExecConfig

DEFAULT_MODEL = "granite-3.0-1b-a400m"  # the model and hardware of the bundled trace's default run
DEFAULT_HARDWARE = "rtx4060-laptop"


@dataclass(frozen=True)
class ExecConfig:
    """How the executor drives the hardware (kernel counts, pinned host memory).

    ``dense_kernels``: launches of a layer's dense part (norms, attention, router, shared
    expert); ``expert_kernels``: launches per batch of GPU experts; ``route_sync``: the router's
    choice is read back to the host before the layer's decision (one copy latency).

    ``engine`` says which fixed costs of the hardware file apply (``ENGINES``): ``"moelab"``
    launches every kernel from Python (``launch_s`` each) and reads the route back
    (``copy_latency_s``); ``"llama.cpp"`` runs captured graphs (``graph_kernel_s`` per kernel) and
    pays one ``split_sync_s`` per layer whose experts or decision are on the host (every policy
    but ``gpu``); ``"mailbox"`` runs the same graphs and hands the CPU's work over through mapped
    flags (``mailbox_s`` each way), with no host synchronisation inside the token.
    """

    dense_kernels: int = 12
    expert_kernels: int = 3
    pinned: bool = True
    route_sync: bool = True
    act_bytes: int = 4  # bytes per hidden-state element copied to and from the CPU pool
    policy: str = ""  # the scheduler policy, for its planning time on the host lane
    engine: str = "moelab"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"ExecConfig.engine: {self.engine!r}, expected one of {', '.join(ENGINES)}")
        for f in ("dense_kernels", "expert_kernels", "act_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"ExecConfig.{f}: {getattr(self, f)}, expected >= 0")


@dataclass(frozen=True)
class HostCosts:
    """The executor's host-thread costs (seconds), from ``Hardware.executor`` (see its keys).

    A layer on the host lane (``simulate.engine``): ``plan_s``; dense issued (``dense_s``), router
    read back (``readback_s``); the engine plans (``layer_plan_s``); with CPU experts the input is
    fetched and the job submitted (``cpu_submit_s``; the pool starts ``cpu_start_s`` later) and the
    GIL handed over (``cpu_handoff_s``); uploads queued (``copy_round_s`` once, ``copy_s`` each; the
    engine's plan takes ``plan_copy_s`` longer per copy of the previous layer); the GPU part queued
    (``gpu_queue_s``, or ``cpu_queue_s`` while the pool computes, + ``gpu_expert_s`` per further
    expert); with CPU experts the caller resumes ``cpu_return_s`` after the pool ends and queues the
    rows and the combine (``cpu_combine_s``), else the combine (``layer_combine_s``). With the
    mapped-memory hand-off (``handoff``: the hardware file has ``handoff_in_s``), a one-token
    layer's CPU experts cost the host only ``cpu_submit_s`` (the gated submit and the input's put);
    the pool starts ``handoff_in_s`` after the GPU has put the input, and the GPU's combine waits
    until ``handoff_out_s`` after the pool ends; the host does not wait. A decode token run as one
    CUDA graph (``scheduler.graph``; the file has ``graph_block_s``) costs the GPU ``graph_block_s``
    per block it completes, the host ``graph_token_s`` per token and ``graph_step_s`` per step the
    graph computed (this policy's planning in place of ``gpu``'s, under which it was measured)."""

    plan_s: float
    dense_s: float
    readback_s: float
    gpu_layer_s: float
    gpu_expert_s: float
    copy_s: float
    cpu_s: float
    wait_poll_s: float
    layer_plan_s: float = 0.0
    layer_combine_s: float = 0.0
    gpu_queue_s: float = 0.0
    cpu_submit_s: float = 0.0
    cpu_handoff_s: float = 0.0
    cpu_queue_s: float = 0.0
    cpu_combine_s: float = 0.0
    cpu_start_s: float = 0.0
    cpu_return_s: float = 0.0
    head_s: float = 0.0
    copy_round_s: float = 0.0
    plan_copy_s: float = 0.0
    handoff: bool = False
    handoff_in_s: float = 0.0
    handoff_out_s: float = 0.0
    graph_block_s: float = 0.0  # token graph (0: the file has none; no graph lane)
    graph_step_s: float = 0.0
    graph_token_s: float = 0.0

    @classmethod
    def from_hardware(cls, hw: Hardware, policy: str) -> "HostCosts":
        """Costs for ``policy``; a file without the split CPU keys (written before them) charges
        ``host_cpu_s`` half before the pool starts and half after it ends, and one without
        ``host_layer_plan_s``/``host_layer_combine_s`` charges all of ``host_gpu_layer_s`` as queueing."""
        ex = hw.executor
        plan = ex.get("plan_s", {})
        plan_s = plan.get(policy, statistics.median(plan.values()) if plan else 0.0)
        g = lambda k: ex.get(k, 0.0)
        layer_plan, layer_combine = g("host_layer_plan_s"), g("host_layer_combine_s")
        queue = max(g("host_gpu_layer_s") - layer_plan - layer_combine, 0.0)
        split = any(k in ex for k in ("host_cpu_submit_s", "host_cpu_handoff_s", "host_cpu_combine_s",
                                      "cpu_start_s", "cpu_return_s"))
        half = 0.0 if split else g("host_cpu_s") / 2
        return cls(plan_s, g("host_dense_s"), g("readback_s"), g("host_gpu_layer_s"), g("host_gpu_expert_s"),
                   g("host_copy_s"), g("host_cpu_s"), g("wait_poll_s"),
                   layer_plan_s=layer_plan, layer_combine_s=layer_combine, gpu_queue_s=queue,
                   cpu_submit_s=g("host_cpu_submit_s") + half, cpu_handoff_s=g("host_cpu_handoff_s"),
                   cpu_queue_s=ex.get("host_cpu_queue_s", queue), cpu_combine_s=g("host_cpu_combine_s") + half,
                   cpu_start_s=g("cpu_start_s"), cpu_return_s=g("cpu_return_s"),
                   head_s=ex.get("host_head_s", g("host_dense_s")), copy_round_s=g("host_copy_round_s"),
                   plan_copy_s=g("host_plan_copy_s"), handoff="handoff_in_s" in ex,
                   handoff_in_s=g("handoff_in_s"), handoff_out_s=g("handoff_out_s"),
                   graph_block_s=g("graph_block_s"),
                   graph_step_s=(max(g("graph_step_s") - plan["gpu"], 0.0) + plan_s if "gpu" in plan  # measured
                                 else g("graph_step_s")),  # under gpu: this policy's planning in place of gpu's
                   graph_token_s=g("graph_token_s"))


class Costs:
    """Precomputed per-layer times (seconds) for one model on one hardware."""

    def __init__(self, model: ModelSpec, hw: Hardware, cfg: ExecConfig = ExecConfig()):
        self.model, self.hw, self.cfg = model, hw, cfg
        L = model.num_layers
        gbw = hw.gpu_gbps(model.dense_quant) * 1e9
        ebw = hw.gpu_gbps(model.expert_quant) * 1e9
        link = hw.h2d_gbps(cfg.pinned) * 1e9
        flops = hw.gpu_tflops * 1e12
        self.expert_bytes = [model.expert_bytes(l) for l in range(L)]
        kernel = hw.launch_s if cfg.engine == "moelab" else hw.graph_kernel_s  # fixed cost per kernel
        # dense part: fixed bytes, KV bytes per context position, flops per token
        self.dense_s = [cfg.dense_kernels * kernel + model.dense_bytes(l) / gbw for l in range(L)]
        self.kv_s_per_pos = [model.kv_bytes_per_position(l) / gbw for l in range(L)]
        self.dense_flop_s = [2 * model.dense_bytes(l) / _bytes_per_weight(model.dense_quant) / flops for l in range(L)]
        # routed experts
        self.gpu_expert_s = [b / ebw for b in self.expert_bytes]
        self.gpu_expert_flop_s = 2 * model.expert_params / flops  # per token
        self.expert_launch_s = cfg.expert_kernels * kernel
        self.upload_s = [hw.copy_latency_s + b / link for b in self.expert_bytes]
        self.promote_s = [kernel + 2 * b / ebw for b in self.expert_bytes]
        cpu_bw = hw.cpu_gbps(model.expert_quant) * 1e9  # decode: min(memory, compute) rate
        self.cpu_expert_s = [b / cpu_bw for b in self.expert_bytes]
        compute_bw = hw.cpu_threads * hw.cpu_thread_gbps * hw.cpu_quant_efficiency.get(model.expert_quant, 1.0) * 1e9
        self.cpu_token_s = [b / compute_bw for b in self.expert_bytes]  # compute per token
        self.cpu_read_s = [b / (hw.cpu_mem_gbps * 1e9) for b in self.expert_bytes]  # weights read once per step
        self.cpu_task_s = hw.cpu_task_s
        self.cpu_call_factor = hw.cpu_call_factor
        act = model.hidden * cfg.act_bytes / link  # one hidden state over the link
        self.combine_s = kernel  # add the CPU result into the layer output
        if cfg.engine == "moelab":
            self.small_copy_s = hw.copy_latency_s + act
            self.route_s = hw.copy_latency_s if cfg.route_sync else 0.0
        elif cfg.engine == "llama.cpp":  # the split's round trip: synchronise, copy out, launch the next split
            self.small_copy_s = act
            self.route_s = hw.split_sync_s if cfg.policy != "gpu" else 0.0
        else:  # mailbox: the GPU goes on with the hits; each direction is one flag hand-off
            self.small_copy_s = hw.mailbox_s + act
            self.route_s = 0.0
        self.token_s = (model.head_bytes() / gbw + cfg.dense_kernels * kernel  # output head, norm, sampling
                        + hw.copy_latency_s)  # sampled id read back
        self.host: HostCosts | None = None
        # a one-token step of hits and uploads only, on the executor's one-token path: None = a
        # batch and its combine; else GPU time one_s + one_expert_s[layer] per expert (executor block)
        self.one_s: float | None = None
        self.one_expert_s: list[float] = []
        self.one_scale = 1.0
        if hw.executor:  # measured executor costs replace the launch counts (docs/FIDELITY.md)
            ex = hw.executor
            self.host = HostCosts.from_hardware(hw, cfg.policy)
            fixed = ex.get("dense_fixed_s", 0.0)
            self.dense_s = [fixed + model.dense_bytes(l) / gbw for l in range(L)]
            self.expert_launch_s = ex.get("gpu_batch_s", 0.0)
            self.combine_s = ex.get("combine_s", 0.0)
            if "gpu_one_s" in ex:  # the one-token path: its two launches, the combine among them
                scale = ex.get("gpu_one_expert_scale", 1.0)
                self.one_s, self.one_expert_s = ex["gpu_one_s"], [scale * e for e in self.gpu_expert_s]
                self.one_scale = scale
            self.head_s = fixed + model.head_bytes() / gbw  # GPU part; read-back on the host lane

    def cost_model(self):
        """These costs as a ``scheduler.CostModel`` (for ``hybrid-cost``, ``hybrid``'s share,
        ``lookahead`` and ``oracle``), in the roofline form the simulator charges: per expert,
        weights read once or compute per token, whichever is longer (``gpu_experts``/
        ``cpu_experts``; one token gives the decode costs); the pool's ``cpu_call_factor``;
        ``layer_s`` is a decode layer's dense part at empty context and its router read-back.
        With an executor block, ``lane`` holds the host thread's costs (``HostCosts``) so that
        ``CostModel.step_s`` charges a layer as ``simulate.engine`` does; ``cpu_task_s`` and
        ``cpu_delay_s`` then also summarise them for the policies that price without the lane
        (the pool's task and the host's CPU hand-off costs; the submit and GIL hand-off)."""
        from .costmodel import CostModel, LaneCosts

        n = len(self.expert_bytes)
        task, delay, lane = self.cpu_task_s, 0.0, None
        if self.host is not None:  # with an executor block, a layer that uses the pool also holds the host thread
            hc = self.host
            # what holds the GPU back after a layer's host part: the next layer's plan and dense
            # issue beyond its GPU time (at empty context), after the last layer the head's issue
            lead = [hc.plan_s + max(hc.dense_s - self.dense_s[l + 1], 0.0) for l in range(n - 1)]
            lead.append(max(hc.head_s - self.head_s, 0.0))
            lane = LaneCosts(pool_task_s=self.cpu_task_s, submit_s=hc.cpu_submit_s, start_s=hc.cpu_start_s,
                             handoff_s=hc.cpu_handoff_s, return_s=hc.cpu_return_s, combine_s=hc.cpu_combine_s,
                             cpu_queue_s=hc.cpu_queue_s, gpu_queue_s=hc.gpu_queue_s, expert_queue_s=hc.gpu_expert_s,
                             copy_round_s=hc.copy_round_s, copy_s=hc.copy_s, plan_copy_s=hc.plan_copy_s,
                             layer_combine_s=hc.layer_combine_s, batch_s=self.expert_launch_s,
                             gpu_combine_s=self.combine_s, handoff=hc.handoff, handoff_in_s=hc.handoff_in_s,
                             handoff_out_s=hc.handoff_out_s, lead_s=lead, one_s=self.one_s,
                             one_scale=self.one_scale,
                             decide_s=max(hc.readback_s + hc.layer_plan_s - self.route_s, 0.0))
            if hc.handoff:  # the GPU puts the input and waits for the rows; the host goes on
                task += hc.cpu_submit_s + hc.handoff_in_s + hc.handoff_out_s
                delay = hc.cpu_submit_s
            else:
                task += (hc.cpu_submit_s + hc.cpu_start_s + hc.cpu_handoff_s + hc.cpu_return_s
                         + max(hc.cpu_combine_s - hc.layer_combine_s, 0.0))
                delay = hc.cpu_submit_s + hc.cpu_handoff_s  # the job is submitted before the GPU work is queued
        # hand-off terms (CostModel's docstring): without the host lane, the hidden state's copies to
        # and from the pool, the combine, and a launch per expert batch; with it, one batch, combine always
        copy, comb, batch = (0.0, 0.0, 0.0) if self.host is not None else (2 * self.small_copy_s, self.combine_s,
                                                                         self.expert_launch_s)
        return CostModel(
            gpu_expert_s=[0.0] * n, gpu_token_s=[self.gpu_expert_flop_s] * n, gpu_read_s=self.gpu_expert_s,
            upload_s=self.upload_s,
            cpu_expert_s=[0.0] * n, cpu_token_s=self.cpu_token_s, cpu_read_s=self.cpu_read_s,
            cpu_task_s=task, layer_s=[d + self.route_s for d in self.dense_s], cpu_delay_s=delay,
            cpu_copy_s=copy, cpu_combine_s=comb, gpu_batch_s=batch,
            cpu_call_factor=tuple(sorted(self.cpu_call_factor.items())), lane=lane)

    # multi-token steps (counts given) ---------------------------------------------------------
    def dense(self, layer: int, ctx: int, num_tokens: int = 1) -> float:
        """GPU time of a layer's dense part for ``num_tokens`` tokens ending at context ``ctx``."""
        if num_tokens == 1:
            return self.dense_s[layer] + ctx * self.kv_s_per_pos[layer]
        mem = self.dense_s[layer] + ctx * self.kv_s_per_pos[layer]
        return max(mem, num_tokens * self.dense_flop_s[layer] + self.cfg.dense_kernels * self.hw.launch_s)

    def gpu_experts(self, layer: int, counts) -> float:
        """GPU time of a batch of experts given each one's token count (no launches)."""
        e, f = self.gpu_expert_s[layer], self.gpu_expert_flop_s
        return sum(max(e, c * f) for c in counts)

    def cpu_call_s(self, layer: int, num_experts: int, counts=None) -> float:
        """CPU pool time of one call on a layer's ``num_experts`` CPU experts (0 when none):
        ``cpu_task_s`` + each expert's time (one token each, or ``counts`` tokens: roofline), times
        ``cpu_call_factor[num_experts]`` where the hardware file measured that count."""
        if not num_experts:
            return 0.0
        if counts is None:
            t = self.cpu_task_s + num_experts * self.cpu_expert_s[layer]
        else:
            t = self.cpu_task_s + self.cpu_experts(layer, counts)
        f = self.cpu_call_factor.get(num_experts)
        return t if f is None else t * f

    def cpu_experts(self, layer: int, counts) -> float:
        """CPU pool time of a layer's CPU experts given each one's token count (no task overhead)."""
        per_tok, read = self.cpu_token_s[layer], self.cpu_read_s[layer]
        return sum(max(read, c * per_tok) for c in counts)


def _bytes_per_weight(quant: str) -> float:
    from .models import QUANT_BLOCKS

    n, b = QUANT_BLOCKS[quant]
    return b / n
