"""A pool whose chosen port is taken before rank 0 listens on it starts on another port
(the EADDRINUSE flake of a CI run: ``free_port`` frees the port it found, and any process's
connection may take it before the rendezvous binds it); any other start failure is not
retried."""
from __future__ import annotations

import socket

import pytest

from parbench import launch


def _ping(ctx):
    return ctx.rank


def test_a_taken_port_is_chosen_again(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports, real = iter([taken]), launch.free_port
        chosen: list[int] = []

        def fake_free_port():
            chosen.append(next(ports, None) or real())
            return chosen[-1]

        monkeypatch.setattr(launch, "free_port", fake_free_port)
        with launch.WorkerPool(1, timeout_s=60) as pool:
            assert pool.run(_ping) == [0]
    assert chosen[0] == taken and len(chosen) == 2 and chosen[1] != taken


def test_the_retries_end(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(launch, "free_port", lambda: taken)
        monkeypatch.setattr(launch, "PORT_TRIES", 2)
        with pytest.raises(launch.RankError, match="EADDRINUSE|address already in use"):
            launch.WorkerPool(1, timeout_s=60)
