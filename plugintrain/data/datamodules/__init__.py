"""Lightning datamodules: token windows, packed chat rows, weighted mixtures and MNIST, all
sharded by data-parallel rank and resumable mid-epoch (:mod:`.resumable`).

They read what :mod:`plugintrain.data.prepare` wrote; they never import it.
"""
