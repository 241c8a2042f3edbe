"""Every on-disk checkpoint concern, on the floor (it imports only :mod:`plugintrain.core`).

``files`` (finding, recovering and safely loading checkpoints), ``dcp`` (sharded DCP
directories of any layout), ``single_file`` (a one-file checkpoint read as DCP),
``lightning_io`` (Lightning's CheckpointIO for one process and ``ddp``), ``portable``
(the LightningModule hooks that make a checkpoint load under any layout) and ``resume``
(what ``--ckpt_path`` means).
"""
