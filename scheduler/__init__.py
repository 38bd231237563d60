"""moelab's scheduler: every policy decision for a GPU expert cache, PCIe link and CPU pool.

Pure: imports only the standard library and numpy, and never reads a clock.
"""
from .audit import Audit, replay
from .cache import Cache
from .core import (Capacity, CapacityError, Decision, Geometry, Move, Policy, Step, Token,
                   pad_slot_bytes)
from .costmodel import CostModel
from .drive import AwaitBackground, EndToken, RunLayer, StartBackground, drive
from .policies import MAX_FILLS_PER_TOKEN, MISS_FRAC_256, POLICIES, make_policy
from .profile import Profile, ProfileError, read_strp, write_strp

__all__ = [
    "Audit", "Cache", "Capacity", "CapacityError", "Decision", "Geometry", "Move", "Policy", "Step",
    "Token", "pad_slot_bytes", "AwaitBackground", "EndToken", "RunLayer", "StartBackground", "drive",
    "replay", "MAX_FILLS_PER_TOKEN", "MISS_FRAC_256", "POLICIES", "make_policy", "Profile", "ProfileError",
    "read_strp", "write_strp", "CostModel",
]
