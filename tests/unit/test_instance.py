"""instance.py's decisions with plain values, and its lock on real files (no processes)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from tests.support.fakes import Log

from qwen4090.base import atomicfile
from qwen4090.launching.instance import (
    ChildRecord,
    Instance,
    InstanceError,
    Listener,
    ProcInfo,
    describe_holders,
    flock_holders,
    instance_name,
    judge_orphans,
    matches_endpoint,
    runtime_dir,
)
from qwen4090.running.portguard import PortWait
from qwen4090.settings.config import from_dict

VLLM = ("/opt/qwen4090/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
ENGINE = ("VLLM::EngineCore",)


def record(members: tuple[ProcInfo, ...] = ()) -> ChildRecord:
    return ChildRecord(pid=500, pgid=500, create_time=1000.0, cmdline=VLLM,
                       supervisor_pid=400, members=members)


# --- where and what name ---------------------------------------------------------------------


def test_runtime_directory_order(tmp_path: Path) -> None:
    cfg = from_dict({"gpu": {"state_directory": str(tmp_path / "state")}})
    assert runtime_dir(cfg, {"RUNTIME_DIRECTORY": f"{tmp_path}/rt:/x"},
                       usable=lambda p: True) == tmp_path / "rt"
    assert runtime_dir(cfg, {}, usable=lambda p: p == "/run/qwen4090") == Path("/run/qwen4090")
    assert runtime_dir(cfg, {}, usable=lambda p: False) == tmp_path / "state"
    plain = from_dict({})
    assert runtime_dir(plain, {"STATE_DIRECTORY": "/var/lib/q"},
                       usable=lambda p: False) == Path("/var/lib/q")


def test_instance_name_is_a_safe_file_name() -> None:
    assert instance_name("127.0.0.1", 8000) == "instance-127.0.0.1-8000"
    assert instance_name("::1", 8000) == "instance-__1-8000"
    assert instance_name("", 80) == "instance-any-80"
    assert "/" not in instance_name("../../etc", 1)


# --- which processes a previous instance left ---------------------------------------------


def test_live_verified_leader_proves_the_whole_group() -> None:
    leader = ProcInfo(500, 1000.0, VLLM, pgid=500)
    engine = ProcInfo(510, 1003.0, ENGINE, pgid=500)
    v = judge_orphans(record(), [leader], [leader, engine])
    assert v.group and [p.pid for p in v.ours] == [500, 510] and not v.unverified


def test_reused_pid_is_never_ours() -> None:
    # pid 500 now belongs to a process born later: a stranger, whatever its group holds.
    stranger = ProcInfo(500, 2000.0, VLLM, pgid=500)
    v = judge_orphans(record(), [stranger], [stranger])
    assert v.ours == [] and not v.group and v.reused == [stranger]
    assert v.unverified == [stranger]


def test_same_pid_and_start_but_other_command_is_not_ours() -> None:
    other = ProcInfo(500, 1000.0, ("/usr/bin/postgres",), pgid=500)
    v = judge_orphans(record(), [other], [other])
    assert v.ours == [] and v.reused == [other]


def test_start_time_tolerance_is_tight() -> None:
    assert ProcInfo(1, 1000.0, VLLM).same_process(ProcInfo(1, 1000.04, VLLM))
    assert not ProcInfo(1, 1000.0, VLLM).same_process(ProcInfo(1, 1000.2, VLLM))


def test_leaderless_group_is_ours_through_a_recorded_member() -> None:
    engine = ProcInfo(510, 1003.0, ENGINE, pgid=500)
    worker = ProcInfo(511, 1004.0, ("VLLM::Worker",), pgid=500)
    rec = record(members=(ProcInfo(510, 1003.0, ENGINE),))
    v = judge_orphans(rec, [engine], [engine, worker])
    assert v.group and {p.pid for p in v.ours} == {510, 511}


def test_leaderless_group_without_proof_is_only_reported() -> None:
    engine = ProcInfo(510, 1003.0, ENGINE, pgid=500)
    v = judge_orphans(record(), [], [engine])
    assert v.ours == [] and v.unverified == [engine] and not v.group


def test_verified_member_that_left_the_group_is_signalled_alone() -> None:
    moved = ProcInfo(510, 1003.0, ENGINE, pgid=777)
    rec = record(members=(ProcInfo(510, 1003.0, ENGINE),))
    v = judge_orphans(rec, [moved], [])
    assert v.ours == [moved] and not v.group


def test_record_round_trip_and_torn_record() -> None:
    rec = record(members=(ProcInfo(510, 1003.5, ENGINE),))
    assert ChildRecord.from_json(rec.to_json()) == rec
    assert ChildRecord.from_json(rec.to_json()[:20]) is None
    assert ChildRecord.from_json('{"pid": "x"}') is None
    assert ChildRecord.from_json("[]") is None


# --- ports ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("ip", "port", "host", "want", "ok"), [
    ("127.0.0.1", 8000, "127.0.0.1", 8000, True),
    ("127.0.0.1", 8001, "127.0.0.1", 8000, False),
    ("0.0.0.0", 8000, "127.0.0.1", 8000, True),
    ("127.0.0.1", 8000, "0.0.0.0", 8000, True),
    ("::", 8000, "127.0.0.1", 8000, True),
    ("::ffff:127.0.0.1", 8000, "127.0.0.1", 8000, True),
    ("10.0.0.5", 8000, "127.0.0.1", 8000, False),
    ("127.0.0.1", 8000, "localhost", 8000, True),
])
def test_matches_endpoint(ip: str, port: int, host: str, want: int, ok: bool) -> None:
    assert matches_endpoint(ip, port, host, want) is ok


def test_describe_holders() -> None:
    cmd = {42: ["python3", "-m", "http.server", "8000"]}
    assert describe_holders([Listener("127.0.0.1", 8000, 42)], cmd, "qwen4090") == \
        "pid 42 (python3 -m http.server 8000)"
    assert describe_holders([Listener("127.0.0.1", 8000, None)], {}, "qwen4090") == \
        "an unknown process (not visible to user qwen4090)"
    assert describe_holders([], {}, "bob") == "an unknown process (not visible to user bob)"
    two = [Listener("0.0.0.0", 1, 42), Listener("::", 1, 42), Listener("::", 1, 43)]
    assert describe_holders(two, cmd, "x") == "pid 42 (python3 -m http.server 8000), pid 43"
    long = describe_holders([Listener("::", 1, 7)], {7: ["x" * 500]}, "x")
    assert len(long) < 230 and long.endswith("...)")


def test_flock_holders_from_proc_locks() -> None:
    text = ("1: FLOCK  ADVISORY  WRITE 1234 08:01:123456 0 EOF\n"
            "1: -> FLOCK  ADVISORY  WRITE 999 08:01:123456 0 EOF\n"
            "2: POSIX  ADVISORY  WRITE 77 08:01:123456 0 EOF\n"
            "3: FLOCK  ADVISORY  WRITE 55 fd:00:123456 0 EOF\n")
    assert flock_holders(text, 8, 1, 123456) == [1234]
    assert flock_holders(text, 253, 0, 123456) == [55]


def test_port_wait_is_bounded_and_says_again_every_30s() -> None:
    w = PortWait()
    assert w.observe(0.0, "pid 1 (x)", 120, 30) == (True, True)
    assert w.observe(1.0, "pid 1 (x)", 120, 30) == (True, False)
    assert w.observe(30.0, "pid 1 (x)", 120, 30) == (True, True)
    assert w.observe(31.0, "pid 2 (y)", 120, 30) == (True, True)  # a new holder is news
    assert w.spent(119.0, 120) is False and w.spent(120.0, 120) is True
    assert w.observe(120.0, "pid 2 (y)", 120, 30) == (False, False)
    assert w.since is None and w.holder == ""  # spent: the next held port starts over
    assert PortWait().observe(5.0, "h", 0, 30) == (False, False)  # port_wait = 0: no wait


# --- the lock on real files ------------------------------------------------------------------


def test_second_lock_on_the_same_port_names_the_holder(tmp_path: Path) -> None:
    cfg = from_dict({"vllm": {"port": 8123}})
    first = Instance.take(cfg, Log(), env={"RUNTIME_DIRECTORY": str(tmp_path)})
    try:
        assert (tmp_path / "instance-127.0.0.1-8123.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(InstanceError) as e:
            Instance.take(cfg, Log(), env={"RUNTIME_DIRECTORY": str(tmp_path)})
        msg = str(e.value)
        assert f"pid {os.getpid()} (" in msg and "instance-127.0.0.1-8123.lock" in msg
        assert "\n" not in msg and "vllm.port" in msg
        other = from_dict({"vllm": {"port": 8124}})  # another port: its own lock
        Instance.take(other, Log(), env={"RUNTIME_DIRECTORY": str(tmp_path)}).close(True)
    finally:
        first.close(group_gone=True)
    again = Instance.take(cfg, Log(), env={"RUNTIME_DIRECTORY": str(tmp_path)})
    again.close(True)


def test_unusable_directory_is_one_line_naming_path_and_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InstanceError) as e:
        Instance.take(from_dict({}), Log(), env={"RUNTIME_DIRECTORY": str(blocker / "rt")})
    msg = str(e.value)
    assert str(blocker / "rt" / "instance-127.0.0.1-8000.lock") in msg
    assert "RuntimeDirectory=qwen4090" in msg and "gpu.state_directory" in msg
    assert "\n" not in msg


def test_behind_the_front_the_lock_is_the_client_ports_and_each_engine_has_its_record(
        tmp_path: Path) -> None:
    # a launch keeps the client address in its config; only its engine endpoint moves
    from qwen4090.launching.launch import configured

    env = {"RUNTIME_DIRECTORY": str(tmp_path)}
    cfg = from_dict({"vllm": {"port": 8300}, "front": {"enabled": True, "engine_port": 18300}})
    inst = Instance.take(cfg, Log(), env=env)
    try:
        serving = configured(cfg)
        standby = configured(cfg, beside=serving.engine)
        assert (serving.engine.port, standby.engine.port) == (18300, 18301)
        inst.follow(standby.config)
        assert inst.lock_path.name == "instance-127.0.0.1-8300.lock"
        assert inst.record_path_for(serving).name == "instance-127.0.0.1-8300.child.json"
        assert inst.record_path_for(standby).name == "instance-127.0.0.1-8300.child-18301.json"
        # after a failover the standby serves on 18301 and the next one starts on 18300
        assert configured(cfg, beside=standby.engine).engine == serving.engine
    finally:
        inst.close(True)


def test_follow_moves_the_lock_to_a_new_port(tmp_path: Path) -> None:
    # without the front a reload may move vLLM's port, and the instance with it
    env = {"RUNTIME_DIRECTORY": str(tmp_path)}
    off = {"front": {"enabled": False}}
    inst = Instance.take(from_dict({"vllm": {"port": 8200}, **off}), Log(), env=env)
    blocker = Instance.take(from_dict({"vllm": {"port": 8202}, **off}), Log(), env=env)
    try:
        inst.follow(from_dict({"vllm": {"port": 8201}, **off}))
        assert inst.lock_path.name == "instance-127.0.0.1-8201.lock"
        Instance.take(from_dict({"vllm": {"port": 8200}, **off}), Log(), env=env).close(True)
        from qwen4090.settings.config import ConfigError
        with pytest.raises(ConfigError) as e:
            inst.follow(from_dict({"vllm": {"port": 8202}, **off}))
        assert "vllm.port" in str(e.value) and "another qwen4090" in str(e.value)
        assert inst.lock_path.name == "instance-127.0.0.1-8201.lock"  # kept what it had
    finally:
        inst.close(True)
        blocker.close(True)


def test_unreadable_record_is_said_and_ignored(tmp_path: Path) -> None:
    log = Log()
    inst = Instance.take(from_dict({}), log, env={"RUNTIME_DIRECTORY": str(tmp_path)})
    try:
        inst.record_path.write_text("{torn")
        assert inst.stop_orphans(1.0) == []
        assert any(e == "child_record_unreadable" for _, e, _ in log.events)
    finally:
        inst.close(True)



def test_listeners_from_psutil_connections() -> None:
    from types import SimpleNamespace as NS

    import psutil

    from qwen4090.launching.instance import listeners

    own = [NS(status=psutil.CONN_LISTEN, laddr=("127.0.0.1", 8000)),  # a process's: no pid
           NS(status=psutil.CONN_ESTABLISHED, laddr=("127.0.0.1", 8000)),
           NS(status=psutil.CONN_LISTEN, laddr=("127.0.0.1", 8001)),
           NS(status=psutil.CONN_NONE, laddr=())]
    assert listeners(own, "127.0.0.1", 8000, pid=7) == [Listener("127.0.0.1", 8000, 7)]
    system = [NS(status=psutil.CONN_LISTEN, laddr=("0.0.0.0", 8000), pid=None),
              NS(status=psutil.CONN_LISTEN, laddr=("::", 8000), pid=9)]
    assert [h.pid for h in listeners(system, "127.0.0.1", 8000)] == [None, 9]


def test_owner_and_holder_with_real_sockets(tmp_path: Path) -> None:
    # This process stands in for "our child's group": a listening socket is ours, a free
    # port is no one's, and a port held by us is named with our pid.
    import socket

    from qwen4090.launching.instance import Instance

    inst = Instance(tmp_path, "127.0.0.1", 0, Log())

    class Me:
        pid = os.getpid()

        def group_members(self) -> list[int]:
            return []

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert inst.owner(Me(), "127.0.0.1", port).ours is False  # bound, not listening
        s.listen()
        assert inst.owner(Me(), "127.0.0.1", port).ours is True
        held = inst.holder("127.0.0.1", port)
        assert held is not None and held.startswith(f"pid {os.getpid()} (")
    assert inst.holder("127.0.0.1", port) is None


# --- a state directory that refuses writes (issue 18.1) -----------------------------------------


def refuse_writes_to(monkeypatch: pytest.MonkeyPatch, suffix: str, code: int,
                     short: bool = False) -> None:
    """os.write into a file whose name ends with ``suffix`` fails with ``code`` (or writes one
    byte: a short write), as on a full disk; every other write goes through."""
    real = os.write

    def write(fd: int, data: bytes) -> int:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name.endswith(suffix):
            if short:
                return real(fd, bytes(data[:1]))
            raise OSError(code, os.strerror(code))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("short", [False, True])
def test_a_full_disk_leaves_the_lock_held_without_a_pid_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short: bool) -> None:
    env = {"RUNTIME_DIRECTORY": str(tmp_path)}
    lock = tmp_path / "instance-127.0.0.1-8000.lock"
    lock.write_text("999999\n")  # an earlier holder's pid: never left half or stale
    refuse_writes_to(monkeypatch, ".lock", errno.ENOSPC, short)
    log = Log()
    inst = Instance.take(from_dict({}), log, env=env)  # raised OSError: [Errno 28]
    try:
        assert lock.read_bytes() == b""
        (said,) = log.named("state_not_saved")
        assert said["path"] == str(lock) and said["cause"] == "disk full (ENOSPC)"
        assert "instance_locked" in log.names()
        # the lock holds: a second run is refused, naming us (found in /proc/locks)
        with pytest.raises(InstanceError) as e:
            Instance.take(from_dict({}), Log(), env=env)
        assert f"pid {os.getpid()} (" in str(e.value)
    finally:
        inst.close(True)


@pytest.mark.parametrize(("code", "words"), [(errno.EROFS, "read-only file system (EROFS)"),
                                             (errno.EACCES, "permission denied (EACCES)")])
def test_an_existing_lock_file_not_writable_is_locked_read_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str) -> None:
    env = {"RUNTIME_DIRECTORY": str(tmp_path)}
    lock = tmp_path / "instance-127.0.0.1-8000.lock"
    lock.write_text("999999\n")  # a stale pid it cannot overwrite
    real_open = os.open

    def open_(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if str(path) == str(lock) and flags & (os.O_RDWR | os.O_WRONLY):
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", open_)
    log = Log()
    inst = Instance.take(from_dict({}), log, env=env)
    try:
        (said,) = log.named("state_not_saved")
        assert said["path"] == str(lock) and said["cause"] == words
        with pytest.raises(InstanceError) as e:  # the kernel's holder, not the stale pid
            Instance.take(from_dict({}), Log(), env=env)
        assert f"pid {os.getpid()} (" in str(e.value) and "999999" not in str(e.value)
    finally:
        inst.close(True)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_lock_file_the_disk_cannot_create_runs_unlocked_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    real_open = os.open

    def open_(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if str(path).endswith(".lock"):
            raise OSError(code, os.strerror(code)) if flags & os.O_CREAT else \
                FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", open_)
    log = Log()
    inst = Instance.take(from_dict({}), log, env={"RUNTIME_DIRECTORY": str(tmp_path)})
    (said,) = log.named("instance_unlocked")
    assert said["path"] == str(inst.lock_path) and "second qwen4090" in said["detail"]
    assert said["cause"] == atomicfile.cause(OSError(code, ""))
    assert [lvl for lvl, e, _ in log.events if e == "instance_unlocked"] == ["error"]
    inst.follow(from_dict({}))  # the same port: not retried, not said again
    assert log.names().count("instance_unlocked") == 1
    inst.close(True)


def test_a_directory_not_ours_is_still_refused(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *a: Any, **kw: Any) -> None:
        if self == tmp_path / "rt":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(InstanceError) as e:  # exit 78 with the fix, as before
        Instance.take(from_dict({}), Log(), env={"RUNTIME_DIRECTORY": str(tmp_path / "rt")})
    assert "gpu.state_directory" in str(e.value)


@pytest.mark.parametrize(("code", "words"), [(errno.ENOSPC, "disk full (ENOSPC)"),
                                             (errno.EROFS, "read-only file system (EROFS)"),
                                             (errno.EACCES, "permission denied (EACCES)")])
def test_the_child_record_that_cannot_be_written_is_said_once_and_never_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str) -> None:
    log = Log()
    inst = Instance.take(from_dict({}), log, env={"RUNTIME_DIRECTORY": str(tmp_path)})
    try:
        first = record()
        inst._write(first, new_leader=True)  # an earlier group's record, on disk
        assert ChildRecord.from_json(inst.record_path.read_text()) == first
        real = atomicfile.write_text

        def refuse(path: Path, text: str) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(atomicfile, "write_text", refuse)
        second = ChildRecord(pid=700, pgid=700, create_time=2000.0, cmdline=VLLM,
                             supervisor_pid=400)
        inst._write(second, new_leader=True)
        assert not inst.record_path.exists()  # never the earlier group's record in its place
        assert inst.record == second  # kept in memory all the same
        inst._refresh([ProcInfo(701, 2001.0, ENGINE, 700)])  # the group grows: a second write
        (said,) = log.named("state_not_saved")
        assert said["path"] == str(inst.record_path) and said["cause"] == words
        assert said["what"] == "the child record" and str(tmp_path) in said["hint"]
        monkeypatch.setattr(atomicfile, "write_text", real)  # space again
        inst._refresh([ProcInfo(702, 2002.0, ENGINE, 700)])
        rec = ChildRecord.from_json(inst.record_path.read_text())
        assert rec is not None and rec.pid == 700 and {m.pid for m in rec.members} == {701, 702}
        (back,) = log.named("state_saved")
        assert back["path"] == str(inst.record_path)
        assert sorted(os.listdir(tmp_path)) == sorted([inst.lock_path.name,
                                                       inst.record_path.name])
    finally:
        inst.close(True)
