"""Routing traces: one versioned schema, importers, synthetic traces and hit-rate statistics.

A :class:`Trace` holds per-row (token) top-k expert ids of every layer, memory-mapped from a
directory; ``Trace.tokens()`` yields the scheduler's tokens. ``load()`` with no path opens the
bundled granite-3.0-1b-a400m trace.
"""
from .format import PHASES, SCHEMA_VERSION, Trace, TraceError, default_trace_path, load
from .importers import IMPORTERS, import_trace

__all__ = ["Trace", "TraceError", "SCHEMA_VERSION", "PHASES", "load", "default_trace_path", "IMPORTERS",
           "import_trace"]
