"""The token graph's gate when a graph block's misses run on the CPU pool (``execute.graph_cpu``):
without CuPy, so that its check is tested on any machine."""
from __future__ import annotations

from scheduler.drive import EndToken, RunLayer
from scheduler.graph import GraphBackoff

from .experts import ExecutorError

__all__ = ["GraphCpuGate", "graph_cpu_wanted"]


def graph_cpu_wanted(flag: bool | None = None) -> bool:
    """Whether a decode token's misses run on the CPU pool inside its graph (the policy then wrapped
    in ``scheduler.graph.CpuMisses``): ``flag`` (``moelab run --graph-cpu``) when given, else the
    ``MOELAB_GRAPH_CPU`` switch (``1``; ``0``, the default: a miss halts the token graph)."""
    if flag is not None:
        return bool(flag)
    from .xp import env_switch

    return env_switch("MOELAB_GRAPH_CPU", "0")


class GraphCpuGate(GraphBackoff):
    """The token graph's back-off (every such token completes, so every token tries) that also
    checks each settled step of a graph token: its decision's CPU experts must be those the graph
    handed to the pool, and it may upload or stream nothing (``expect`` is given the graph's
    per-block experts before the token's steps are settled)."""

    def __init__(self) -> None:
        super().__init__()
        self._expect: list = []
        self._next = 0

    def expect(self, cpu: list) -> None:
        self._expect, self._next = cpu, 0

    def see(self, item) -> None:
        super().see(item)
        k = type(item)
        if k is RunLayer and self._next < len(self._expect):
            d = item.decision
            want = self._expect[self._next]
            self._next += 1
            if d.uploads or d.streams or sorted(d.cpu) != sorted(want):
                raise ExecutorError(
                    f"block {d.layer}: the token graph computed experts {list(want)} on the CPU but the decision "
                    f"says cpu {list(d.cpu)}, uploads {list(d.uploads)}, streams {list(d.streams)}; with "
                    "MOELAB_GRAPH_CPU=1 wrap the policy in scheduler.graph.CpuMisses")
        elif k is EndToken:
            self._expect, self._next = [], 0
