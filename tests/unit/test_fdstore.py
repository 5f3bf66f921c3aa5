"""The client port in systemd's file descriptor store (issue 31.1): what systemd passes, which
socket is taken, and the FDSTORE message with the socket attached; and the front that accepts
on a kept socket instead of binding.  The restart under systemd: tests/system/in-guest.sh."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
from tests.support.fakes import Log
from tests.support.upstream import Upstream, free_port, request, upstream

from qwen4090.base import fdstore
from qwen4090.base.steering import Serve
from qwen4090.commandline import cli
from qwen4090.settings.config import from_dict

__all__ = ["upstream"]


def listener(host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.bind((host, 0))
    s.listen(8)
    return s


def test_what_systemd_passed_is_taken_by_name_and_the_variables_are_gone() -> None:
    a, b = listener(), listener()
    base = 400  # the fds systemd would pass from 3 on, placed high to stay clear of pytest's
    os.dup2(a.fileno(), base)
    os.dup2(b.fileno(), base + 1)
    env = {"LISTEN_FDS": "2", "LISTEN_PID": str(os.getpid()),
           "LISTEN_FDNAMES": "client:other", "PATH": "/bin"}
    a.close()
    b.close()
    got = fdstore.passed(env, first=base)
    assert env == {"PATH": "/bin"}  # vLLM and any child never see them
    assert got.take(fdstore.CLIENT) == [base] and not os.get_inheritable(base)
    assert got.close_rest() == ["other"]
    with pytest.raises(OSError):
        os.fstat(base + 1)  # closed
    os.close(base)
    # another process's (LISTEN_PID): not ours, nothing taken
    env = {"LISTEN_FDS": "1", "LISTEN_PID": "1", "LISTEN_FDNAMES": "client"}
    assert fdstore.passed(env, first=base).by_name == {} and env == {}


def test_the_kept_socket_is_used_only_where_the_config_listens() -> None:
    s = listener()
    port = s.getsockname()[1]
    got, why = fdstore.client_socket([os.dup(s.fileno())], "127.0.0.1", port)
    assert got is not None and why == "" and got.getsockname() == ("127.0.0.1", port)
    got.close()
    fd = os.dup(s.fileno())
    got, why = fdstore.client_socket([fd], "127.0.0.1", port + 1)
    assert got is None and f"it listens on 127.0.0.1:{port}" in why and f":{port + 1}" in why
    with pytest.raises(OSError):
        os.fstat(fd)  # closed: systemd is told to let go of it too (cli.open_front)
    s.close()


def test_the_store_message_carries_the_socket(tmp_path: Path) -> None:
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "notify"))
    sink.settimeout(10)  # a message that never comes fails the test, never hangs it
    s = listener()
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    assert fdstore.send(env, fdstore.store_message(), [s.fileno()]) is None
    msg, fds, _, _ = socket.recv_fds(sink, 4096, 4)
    assert msg == b"FDSTORE=1\nFDNAME=client" and len(fds) == 1
    with socket.socket(fileno=fds[0]) as got:
        assert got.getsockname() == s.getsockname()  # the same listening socket
    assert fdstore.send(env, fdstore.remove_message()) is None
    assert sink.recv(4096) == b"FDSTOREREMOVE=1\nFDNAME=client"
    assert fdstore.send({}, fdstore.store_message(), [s.fileno()]) == ""  # no systemd
    s.close()
    sink.close()


def cfg_on(port: int, upstream_port: int, **front: Any) -> Any:
    return from_dict({"vllm": {"host": "127.0.0.1", "port": port},
                      "front": {"enabled": True, "engine_port": upstream_port, **front}})


def test_the_front_accepts_on_the_kept_socket_and_stores_a_new_one(upstream: Upstream,
                                                                     tmp_path: Path) -> None:
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "notify"))
    sink.settimeout(10)  # a message that never comes fails the test, never hangs it
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    kept = listener()
    port = kept.getsockname()[1]
    # a client connects while no supervisor runs: it waits in the socket's backlog
    early = socket.create_connection(("127.0.0.1", port), timeout=5)
    log = Log()
    door = cli.open_front(cfg_on(port, upstream.port), log, lambda s: None, lambda: False,
                          kept=[os.dup(kept.fileno())], env=env)
    kept.close()  # systemd's copy, in the test: the front's own copy keeps listening
    try:
        assert door is not None and "client_port_kept" in log.names()
        early.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        door.command(Serve("127.0.0.1", upstream.port, 1))  # the engine is READY
        assert early.recv(4096).startswith(b"HTTP/1.1 200")  # accepted by the new front
        assert request(port)[0] == 200
        sink.setblocking(False)
        with pytest.raises(BlockingIOError):
            sink.recv(4096)  # a kept socket is not stored again
    finally:
        early.close()
        door.stop() if door is not None else None
    # a fresh bind: the socket goes into the store
    log = Log()
    port2 = free_port()
    door = cli.open_front(cfg_on(port2, upstream.port), log, lambda s: None, lambda: False,
                          kept=[], env=env)
    try:
        assert door is not None and "client_port_stored" in log.names()
        sink.settimeout(10)
        msg, fds, _, _ = socket.recv_fds(sink, 4096, 4)
        assert msg == b"FDSTORE=1\nFDNAME=client"
        with socket.socket(fileno=fds[0]) as got:
            assert got.getsockname() == ("127.0.0.1", port2)
    finally:
        door.stop() if door is not None else None
        sink.close()


def test_a_kept_socket_for_another_port_is_let_go(upstream: Upstream, tmp_path: Path) -> None:
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "notify"))
    sink.settimeout(10)  # a message that never comes fails the test, never hangs it
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    old = listener()
    new_port = free_port()
    log = Log()
    door = cli.open_front(cfg_on(new_port, upstream.port), log, lambda s: None, lambda: False,
                          kept=[os.dup(old.fileno())], env=env)
    try:
        assert door is not None
        (released,) = log.named("client_port_released")
        assert "the config says 127.0.0.1:" in released["reason"]
        assert sink.recv(4096) == b"FDSTOREREMOVE=1\nFDNAME=client"
        msg, fds, _, _ = socket.recv_fds(sink, 4096, 4)
        assert msg == b"FDSTORE=1\nFDNAME=client"  # the new port's, stored
        with socket.socket(fileno=fds[0]) as got:
            assert got.getsockname() == ("127.0.0.1", new_port)
    finally:
        door.stop() if door is not None else None
        old.close()
        sink.close()
