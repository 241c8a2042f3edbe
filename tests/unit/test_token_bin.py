"""llm.c token files: round trips and header checks."""

import numpy as np
import pytest

from plugintrain.data import TokenFileError, read_token_bin, write_token_bin
from plugintrain.data.token_bin import MAGIC


@pytest.mark.parametrize(
    ("tokens", "version", "dtype"),
    [([0, 1, 50256, 65535], 1, np.uint16), ([0, 128000, 128255, 7], 2, np.uint32)],
)
def test_round_trip(tmp_path, tokens, version, dtype):
    path = write_token_bin(tmp_path / "x.bin", tokens)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [MAGIC, version, len(tokens)]
    out = read_token_bin(path)
    assert out.dtype == dtype
    assert out.tolist() == tokens
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no temporary file left


def test_empty_file_round_trips(tmp_path):
    assert len(read_token_bin(write_token_bin(tmp_path / "x.bin", []))) == 0


def test_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="non-negative"):
        write_token_bin(tmp_path / "x.bin", [3, -1])
    with pytest.raises(ValueError, match="uint32"):
        write_token_bin(tmp_path / "x.bin", [2**32])
    assert not (tmp_path / "x.bin").exists()


def _corrupt(tmp_path, index=None, value=None, cut=0):
    path = write_token_bin(tmp_path / "x.bin", list(range(10)))
    data = bytearray(path.read_bytes())
    if index is not None:
        data[index * 4 : index * 4 + 4] = np.int32(value).tobytes()
    path.write_bytes(bytes(data[: len(data) - cut]))
    return path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"index": 0, "value": 1234}, r"bad magic number: expected 20240520, found 1234"),
        ({"index": 1, "value": 3}, r"bad version: expected one of \[1, 2\], found 3"),
        ({"cut": 2}, r"bad file size for a token count of 10: expected 1044 bytes, found 1042"),
        ({"index": 2, "value": 11}, r"token count of 11: expected 1046 bytes, found 1044"),
        ({"index": 2, "value": -1}, r"bad token count"),
        ({"cut": 1030}, r"bad header size: expected 1024 bytes, found 14"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, kwargs, message):
    path = _corrupt(tmp_path, **kwargs)
    with pytest.raises(TokenFileError, match=message) as err:
        read_token_bin(path)
    assert str(path) in str(err.value)
