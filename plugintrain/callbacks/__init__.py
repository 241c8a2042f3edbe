"""Callbacks shipped with plugintrain."""

from plugintrain.callbacks.throughput import TokenThroughputMonitor

__all__ = ["TokenThroughputMonitor"]
