"""A scheduling round acts only while its replica still holds the lease: a round that
outlived its lease (a replica paused, a slow poll, a slow store) commits and launches
nothing more once another replica took it over (see [Note: a round fenced by its
lease] in api/scheduler.py)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from sqlalchemy import update

from api.db import Lease, utcnow
from api.scheduler import LEASE, Scheduler
from tests.api.test_routes import TINY


def test_a_round_whose_lease_lapsed_admits_and_launches_nothing_more(harness, tmp_path):
    alice = harness.headers(harness.tenant_token("alice"))
    jobs = [
        harness.client.post("/v1/jobs", json={"spec": TINY}, headers=alice).json()["id"]
        for _ in range(2)
    ]
    a = harness.service.scheduler
    (tmp_path / "b").mkdir()
    b = Scheduler(
        harness.service.sessions,
        harness.backend,
        dataclasses.replace(harness.settings, data_dir=tmp_path / "b"),
    )
    assert a.holder != b.holder
    fits, paused = harness.backend.fits, []

    def pause_after_the_first(spec):
        if harness.backend.launched and not paused:  # A admitted one, then stalls
            paused.append(True)
            with harness.service.sessions() as session:  # past its lease...
                session.execute(update(Lease).values(expires_at=utcnow() - timedelta(seconds=1)))
                session.commit()
            assert b.tick() and b.leader  # ...which B takes, admitting what is queued
        return fits(spec)

    harness.backend.fits = pause_after_the_first
    assert a.tick() is False and not a.leader  # the round stopped at its next write
    harness.backend.fits = fits
    assert sorted(harness.backend.launched) == sorted(jobs)  # each launched once
    with harness.service.sessions() as session:
        holder = session.get(Lease, LEASE).holder
    assert holder == b.holder
    assert a.tick() is False  # A stays standby while B renews
