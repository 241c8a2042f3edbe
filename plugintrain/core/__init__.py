"""The floor: what strategies, precision plugins, models and checkpoints share, importing
nothing else of plugintrain.

``contracts`` (the protocols between packages), ``pretrained`` (models -> weight files),
``tensor_boxes``, ``initialization``, ``profiling``, ``memory``, ``peak_flops``,
``atomic_files``, ``bits_per_byte`` (the one formula), ``elastic`` (torchrun-restarted
workers), ``lightning_seam`` (every private of Lightning that plugintrain touches),
``signal_watch`` (signals seen at once, the watchdog) and ``lazy`` (package faces that
import their names on first use).
"""
