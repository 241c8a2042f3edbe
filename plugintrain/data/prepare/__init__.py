"""``plugintrain prepare``: the user's documents and conversations, and the offline assets
(Shakespeare, MNIST), turned into the folders the datamodules read.

A new input format is one reader registered in :mod:`.text_sources` (``READERS``); chat
rows in a new shape are one entry of :mod:`.chat_formats` (``FORMATS``).
"""
