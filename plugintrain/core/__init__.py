"""The floor: what strategies, precision plugins, models and checkpoints share, importing
nothing else of plugintrain.

``contracts`` (the protocols between packages), ``pretrained`` (models -> weight files),
``tensor_boxes``, ``initialization``, ``profiling``, ``memory``, ``peak_flops``,
``atomic_files`` and ``elastic`` (torchrun-restarted workers).
"""
