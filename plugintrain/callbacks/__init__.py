"""Callbacks shipped with plugintrain."""

from plugintrain.callbacks.display import CountedFlopsSummary, StepProgressBar
from plugintrain.callbacks.evaluate import Evaluate
from plugintrain.callbacks.graceful_stop import GracefulStop
from plugintrain.callbacks.host_memory import ReleaseFreedMemory
from plugintrain.callbacks.lora import LoRA
from plugintrain.callbacks.phase_profiler import PhaseProfiler
from plugintrain.callbacks.precision_check import PrecisionCheck
from plugintrain.callbacks.step_stats import StepStatsMonitor
from plugintrain.callbacks.throughput import TokenThroughputMonitor

__all__ = [
    "CountedFlopsSummary",
    "Evaluate",
    "GracefulStop",
    "LoRA",
    "PhaseProfiler",
    "PrecisionCheck",
    "ReleaseFreedMemory",
    "StepProgressBar",
    "StepStatsMonitor",
    "TokenThroughputMonitor",
]
