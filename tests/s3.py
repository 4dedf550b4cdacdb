"""An S3-compatible server on 127.0.0.1 for the tests (moto's server mode), with one
bucket. tests/conftest.py offers the ``s3_server`` fixture to every test module."""

from __future__ import annotations

import pytest

from zeroservice.checkpoint.storage import ENDPOINT_ENV

BUCKET = "zs-checkpoints"


@pytest.fixture(scope="module")
def s3_server():
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        ENDPOINT_ENV: f"http://{host}:{port}",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)  # the spawned ranks inherit them
        mp.delenv("AWS_PROFILE", raising=False)
        import boto3

        boto3.client("s3", endpoint_url=env[ENDPOINT_ENV]).create_bucket(Bucket=BUCKET)
        yield env
    server.stop()
