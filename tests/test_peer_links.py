"""distributed/links.py: an idle rank waits on the sockets its collectives arrive on, and
stops waiting there where they do not arrive (another backend)."""

import socket
import time

from mlxmtp.distributed.links import PeerLinks, open_sockets


def test_the_sockets_a_process_opened_are_found():
    a, b = socket.socketpair()
    try:
        assert {a.fileno(), b.fileno()} <= open_sockets()
    finally:
        a.close()
        b.close()


def test_a_wait_ends_when_a_peer_sends_and_after_its_patience_otherwise():
    a, b = socket.socketpair()
    with a, b:
        links = PeerLinks([a.fileno()], patience=0.2)
        started = time.monotonic()
        assert links.wait_for_data() is False
        assert 0.15 < time.monotonic() - started < 2
        b.send(b"x")
        assert links.wait_for_data() is True
        assert a.recv(1) == b"x"  # the wait left the data for the collective


def test_waits_end_where_rank_0_s_data_never_shows_on_the_sockets():
    a, b = socket.socketpair()
    with a, b:
        links = PeerLinks([a.fileno()], patience=0.4)
        links.joined(False, seconds=0.5)  # rank 0 merely late: not a miss
        for _ in range(PeerLinks.MISSES - 1):
            links.joined(False, seconds=0.01)
        links.joined(True, seconds=0.01)  # data did show: the count starts again
        assert links.fds and links.misses == 0
        for _ in range(PeerLinks.MISSES):
            links.joined(False, seconds=0.01)
        assert links.fds == []
        started = time.monotonic()
        assert links.wait_for_data() is False and time.monotonic() - started < 0.1


def test_no_sockets_no_wait():
    started = time.monotonic()
    assert PeerLinks([], patience=5).wait_for_data() is False
    assert time.monotonic() - started < 0.1


def test_a_socket_ready_with_nothing_to_read_is_left_out():
    """A socket at end of file (or failed, or listening) is always ready: waiting on it
    would not wait. Left out, the wait goes on on the others."""
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with a, b, c, d:
        d.close()  # c: at end of file from now on
        links = PeerLinks([a.fileno(), c.fileno()], patience=0.3)
        started = time.monotonic()
        assert links.wait_for_data() is False
        assert time.monotonic() - started > 0.25 and links.fds == [a.fileno()]
        b.send(b"y")
        assert links.wait_for_data() is True and a.recv(1) == b"y"
