"""The records of a W&B offline run file (``offline-run-*/run-*.wandb``), parsed with
wandb's own protobuf schema (``wandb.proto.wandb_internal_pb2.Record``).

wandb 0.31 ships no reader of these files in Python (its Go core writes and syncs them),
so the framing is read here: a 7-byte header (``:W&B``, magic 0xBEE1, version) and then
LevelDB's log format, 32 KiB blocks of records with a 7-byte header each (CRC-32C,
length, type: FULL 1, FIRST 2, MIDDLE 3, LAST 4), a record split across blocks joined
again.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Each ``Record`` of the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path}: not a W&B run file ({ident!r}, {magic:#x})")
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's zero-filled tail
            position += left
            continue
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path) -> list[dict[str, Any]]:
    """Each logged row (``run.log``) of the file: its keys and values."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's config as the file records its updates (``run.config``)."""
    values: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values
