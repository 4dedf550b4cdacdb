"""Training data in object storage (s3:// through fsspec/s3fs), against moto's S3 server
on 127.0.0.1: text and token objects give the samples their local copies give, a token
object is read in ranged GETs of one sample each (never downloaded whole), and a
missing object or an id outside the vocabulary is named."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from tests.s3 import BUCKET
from tests.workers.jobs import tiny_job
from workers.build import build_dataset
from zeroservice.checkpoint.storage import ObjectPath, storage_for


def _put(name: str, data: bytes) -> str:
    uri = f"s3://{BUCKET}/data/{uuid.uuid4().hex[:8]}/{name}"
    loc = ObjectPath(uri)
    storage_for(loc).write_bytes(loc, data)
    return uri


def _pair(tmp_path, kind: str, data: bytes, **extra):
    """The dataset of ``data`` from a local file and from an object."""
    local = tmp_path / "data.bin"
    local.write_bytes(data)
    uri = _put("data.bin", data)
    specs = [{"kind": kind, "path": p, **extra} for p in (str(local), uri)]
    return [build_dataset(tiny_job(data=s)) for s in specs]


def test_a_text_object_samples_as_its_local_copy(s3_server, tmp_path):
    data = bytes(range(256)) * 8
    local, remote = _pair(tmp_path, "text", data)
    for i in range(20):
        assert torch.equal(local.sample(i), remote.sample(i))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_token_object_samples_as_its_local_copy_in_ranged_reads(s3_server, tmp_path, dtype):
    ids = (np.arange(5000) * 7 % 256).astype(np.dtype(dtype).newbyteorder("<"))
    local, remote = _pair(tmp_path, "tokens", ids.tobytes(), dtype=dtype)
    assert len(remote.ids) == len(ids)
    reads = []
    reader = storage_for(ObjectPath(str(remote.path))).open_read(ObjectPath(str(remote.path)))
    read = reader.read
    reader.read = lambda n=-1: reads.append(n) or read(n)  # type: ignore[method-assign]
    remote.ids._reader = reader
    for i in range(20):
        assert torch.equal(local.sample(i), remote.sample(i))
    seq = remote.seq_len
    assert reads == [(seq + 1) * ids.itemsize] * 20  # one sample's bytes per read


def test_a_missing_object_and_a_bad_id_are_named(s3_server):
    missing = f"s3://{BUCKET}/data/{uuid.uuid4().hex[:8]}/none.bin"
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such object"):
        build_dataset(tiny_job(data={"kind": "tokens", "path": missing}))
    bad = _put("bad.bin", np.full(100, 300, dtype="<u2").tobytes())
    ds = build_dataset(tiny_job(data={"kind": "tokens", "path": bad}))
    with pytest.raises(ValueError, match="a token id near offset .* outside the vocabulary") as e:
        ds.sample(0)
    assert "300" not in str(e.value)
