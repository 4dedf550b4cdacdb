import os

# Keep every collective on loopback.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# Stage 3's debug check: every gather confirms that all ranks fetch the same unit.
os.environ.setdefault("ZEROSERVICE_CHECK_GATHERS", "1")
# Ranks of run_local forked from one warm server instead of each importing torch
# (see [Note: ranks forked from a warm server] in zeroservice/launch.py); the tests that
# measure a rank's memory ask for spawned ranks, as the benchmarks use.
os.environ.setdefault("ZEROSERVICE_LAUNCH_START", "forkserver")

from tests.s3 import s3_server  # noqa: E402, F401 (the fixture, for every test module)
