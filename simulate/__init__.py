"""moelab's simulator: a SimPy model of the copy stream, GPU and CPU pool, driven by the scheduler.

``run(SimConfig(...))`` simulates one configuration; ``Simulator`` consumes ``scheduler.drive``
items directly. The only package that imports simpy. The hardware description, the timing model
(``Costs``) and model geometry live in ``scheduler`` (the executor and the policies read them too)
and are re-exported here.
"""
from scheduler.costs import Costs, ExecConfig
from scheduler.hardware import Hardware, HardwareError, hardware_presets, load_hardware
from scheduler.models import MODEL_PRESETS, QUANT_BLOCKS, ModelSpec, load_model, quant_bytes

from .engine import SimResult, Simulator
from .run import SimConfig, SimError, build_capacity, run

__all__ = ["Costs", "ExecConfig", "SimResult", "Simulator", "Hardware", "HardwareError", "hardware_presets",
           "load_hardware", "MODEL_PRESETS", "QUANT_BLOCKS", "ModelSpec", "load_model", "quant_bytes",
           "SimConfig", "SimError", "build_capacity", "run"]
