"""The client port outlives the supervisor process (issue 31.1): systemd's file descriptor store.

Once the front has bound the client port, the supervisor hands a copy of the listening socket
to systemd (``FDSTORE=1``, ``FDNAME=client``, sd_pid_notify_with_fds).  systemd keeps it while
the service is restarted (``systemctl restart``: a job is queued) or restarted after a death
(``Restart=``), and passes it to the next supervisor (``LISTEN_FDS``, ``LISTEN_FDNAMES``),
whose front accepts on it instead of binding.  Meanwhile the socket never stops listening:
a client that connects while no supervisor runs waits in the kernel's backlog (the front's is
1024) and is accepted by the next front, never refused.  A stop (``systemctl stop``, or a
death that is not restarted) empties the store, and the port closes.

Measured on Debian 12's systemd 252 (docs/architecture.md, "The client port across restarts"):
a socket unit (qwen4090.socket) would keep it too, but would duplicate ``vllm.host:vllm.port``
in a second file and start the service on a connection after a stop; the store needs neither.

Matching: a stored socket is used only when it listens where the config says now (a restart
after ``vllm.port`` moved gets it back, closes it and removes it from the store:
``FDSTOREREMOVE=1``, so that systemd lets go of the old port), and only when the front binds
one socket (a host name that resolves to several addresses, "localhost", binds each anew).
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

CLIENT = "client"  # FDNAME of the client port's listening socket
LISTEN_ENV = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
FIRST_FD = 3  # SD_LISTEN_FDS_START


@dataclass
class Passed:
    """What systemd passed this process: file descriptors by name (empty outside systemd or
    with nothing stored)."""

    by_name: dict[str, list[int]] = field(default_factory=dict)

    def take(self, name: str) -> list[int]:
        return self.by_name.pop(name, [])

    def close_rest(self) -> list[str]:
        """Close what nobody took (names of a store that are not ours any more)."""
        names = sorted(self.by_name)
        for fds in self.by_name.values():
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.by_name.clear()
        return names


def passed(env: MutableMapping[str, str], pid: int | None = None, first: int = FIRST_FD
           ) -> Passed:
    """The descriptors systemd passed this process (``LISTEN_FDS`` for ``LISTEN_PID``), by
    name; the variables are removed from ``env`` (a child must not take them for its own) and
    each descriptor is made close-on-exec (vLLM is started with close_fds, but a stray exec
    must not carry the client port either)."""
    values = {k: env.pop(k, None) for k in LISTEN_ENV}
    count, owner = values["LISTEN_FDS"], values["LISTEN_PID"]
    if not count or not owner or owner != str(os.getpid() if pid is None else pid):
        return Passed()
    try:
        n = int(count)
    except ValueError:
        return Passed()
    names = (values["LISTEN_FDNAMES"] or "").split(":") if values["LISTEN_FDNAMES"] else []
    out = Passed()
    for i in range(max(0, n)):
        fd = first + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue  # not open: nothing to take
        name = names[i] if i < len(names) and names[i] else "unknown"
        out.by_name.setdefault(name, []).append(fd)
    return out


def wanted(host: str, port: int) -> set[tuple[int, str, int]] | str:
    """Where the front would listen: (family, address, port) of each socket it binds for
    ``host:port``, or why that cannot be told."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"{host}:{port} does not resolve ({e})"
    return {(int(fam), str(addr[0]), int(addr[1])) for fam, _, _, _, addr in infos}


def listening_at(fd: int) -> tuple[int, str, int] | str:
    """(family, address, port) a passed descriptor listens on, or why it is not a listening
    TCP socket."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError as e:
        return f"fd {fd}: {e.strerror or e}"
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return f"fd {fd} is not a TCP socket"
        if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return f"fd {fd} is not listening"
        addr = s.getsockname()
        return int(s.family), str(addr[0]), int(addr[1])
    finally:
        s.close()


def client_socket(fds: list[int], host: str, port: int) -> tuple[socket.socket | None, str]:
    """The passed client socket when it is the one socket the front would bind for
    ``host:port`` (the caller owns it then); else None and why (every fd of ``fds`` closed)."""
    want = wanted(host, port)
    why = ""
    if isinstance(want, str):
        why = want
    elif len(fds) != 1 or len(want) != 1:
        why = f"{len(fds)} stored for {len(want)} address(es) of {host}:{port}"
    else:
        at = listening_at(fds[0])
        if isinstance(at, str):
            why = at
        elif at not in want:
            why = f"it listens on {at[1]}:{at[2]}, the config says {host}:{port}"
        else:
            return socket.socket(fileno=fds[0]), ""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    return None, why


def store_message(name: str = CLIENT) -> bytes:
    return f"FDSTORE=1\nFDNAME={name}".encode()


def remove_message(name: str = CLIENT) -> bytes:
    return f"FDSTOREREMOVE=1\nFDNAME={name}".encode()


def send(env: Mapping[str, str], message: bytes, fds: Sequence[int] = ()) -> str | None:
    """One notify datagram with ``fds`` attached (SCM_RIGHTS) to $NOTIFY_SOCKET; None when
    sent, else why not ("" when there is no systemd to tell)."""
    addr = env.get("NOTIFY_SOCKET") or ""
    if not addr:
        return ""
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            # (socket.send_fds drops its address argument: sendmsg with SCM_RIGHTS by hand)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] \
                if fds else []
            s.sendmsg([message], rights, 0, addr)
    except OSError as e:
        return f"sd_notify to {env.get('NOTIFY_SOCKET')} failed: {e}"
    return None
