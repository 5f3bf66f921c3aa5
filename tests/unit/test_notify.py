from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen4090.notify import Notifier, child_environment


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        addr = str(tmp_path / "notify.sock")
        sock.bind(addr)
        name = addr
    else:
        name = f"@qwen4090-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name[1:])
    sock.settimeout(2)
    yield name, sock
    sock.close()


def recv(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_messages_reach_a_real_socket(notify_socket: Any) -> None:
    name, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": name})
    assert n.ready("ready: tiny")
    assert recv(sock) == ["READY=1", "STATUS=ready: tiny"]
    n.extend_timeout(1.5)
    assert recv(sock) == ["EXTEND_TIMEOUT_USEC=1500000"]
    n.reloading()
    msg = recv(sock)
    assert msg[0] == "RELOADING=1" and msg[1].startswith("MONOTONIC_USEC=")
    assert int(msg[1].split("=")[1]) > 0
    n.stopping("stopping")
    assert recv(sock) == ["STOPPING=1", "STATUS=stopping"]
    n.watchdog()
    assert recv(sock) == ["WATCHDOG=1"]
    n.close()


def test_no_socket_is_a_noop() -> None:
    n = Notifier({})
    assert not n.enabled and not n.ready("x") and n.watchdog_interval is None


def test_watchdog_interval_is_half_and_respects_pid() -> None:
    assert Notifier({"WATCHDOG_USEC": "10000000"}).watchdog_interval == 5.0
    assert Notifier({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}).watchdog_interval is None
    mine = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_interval == 2.0


def test_send_error_reported_once(tmp_path: Path) -> None:
    errors: list[str] = []
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")}, on_error=errors.append)
    assert not n.status("a") and not n.status("b")
    assert len(errors) == 1 and "absent.sock" in errors[0]
    n.close()


def test_child_environment_drops_notify_variables() -> None:
    env = child_environment({"NOTIFY_SOCKET": "x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2",
                             "PATH": "/bin"})
    assert env == {"PATH": "/bin"}
