"""moelab's simulator: a SimPy model of the copy stream, GPU and CPU pool, driven by the scheduler.

``run(SimConfig(...))`` simulates one configuration; ``Simulator`` consumes ``scheduler.drive``
items directly. The only package that imports simpy.
"""
from .costs import Costs, ExecConfig
from .engine import SimResult, Simulator
from .hardware import Hardware, HardwareError, hardware_presets, load_hardware
from .models import MODEL_PRESETS, QUANT_BLOCKS, ModelSpec, load_model, quant_bytes
from .run import SimConfig, SimError, build_capacity, run

__all__ = ["Costs", "ExecConfig", "SimResult", "Simulator", "Hardware", "HardwareError", "hardware_presets",
           "load_hardware", "MODEL_PRESETS", "QUANT_BLOCKS", "ModelSpec", "load_model", "quant_bytes",
           "SimConfig", "SimError", "build_capacity", "run"]
