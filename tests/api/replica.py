"""One API replica on a fake cluster, as a process of its own (``python -m
tests.api.replica``): several of them share one store in the replication tests.
Settings come from the environment, as for the real service."""

from __future__ import annotations

import uvicorn

from api.main import create_app
from api.service import Service
from api.settings import Settings
from tests.api.fakes import FakeBackend


def main() -> None:
    settings = Settings.from_env()
    service = Service(settings, FakeBackend(cpus=64.0))
    uvicorn.run(create_app(service), host=settings.host, port=settings.port, log_level="error")


if __name__ == "__main__":
    main()
