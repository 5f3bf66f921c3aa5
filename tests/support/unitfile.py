"""Test support: read systemd unit files and check DeviceAllow= against a machine's devices.

Shared by tests/unit/test_packaging.py (samples of /proc/devices from old and new NVIDIA
drivers) and tests/gpu/test_gpu_devices.py (the real /proc/devices and /dev/nvidia* of a GPU
machine). It models what systemd does with ``DeviceAllow=char-NAME ACCESS`` under
``DevicePolicy=closed``: at start, NAME is matched (fnmatch, systemd.resource-control(5)) against
the character-device groups of /proc/devices, and each match allows its whole major number.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# packaging/debian in the repository; debian/ in the source package (autopkgtest)
DEBIAN = next((d for d in (ROOT / "packaging" / "debian", ROOT / "debian") if d.is_dir()),
              ROOT / "packaging" / "debian")
UNITS = ("qwen4090.service", "qwen4090@.service")


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections -> (key, value) in order; repeated keys kept, continuation lines joined."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        if sep and current is not None:
            current.append((key.strip(), value.strip()))
    return sections


def values(text: str, section: str, key: str) -> list[str]:
    return [v for k, v in parse_unit(text).get(section, []) if k == key]


def device_allows(text: str) -> list[tuple[str, str]]:
    """(specifier, access) of each DeviceAllow= line; access defaults to rwm."""
    out = []
    for v in values(text, "Service", "DeviceAllow"):
        spec, _, access = v.partition(" ")
        out.append((spec, access.strip() or "rwm"))
    return out


def char_groups(proc_devices: str) -> list[tuple[int, str]]:
    """(major, name) of the "Character devices:" part of /proc/devices."""
    out, in_char = [], False
    for line in proc_devices.splitlines():
        if line.strip().endswith("devices:"):
            in_char = line.strip() == "Character devices:"
            continue
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1]))
    return out


def allowed_majors(allows: list[tuple[str, str]], proc_devices: str) -> dict[int, set[str]]:
    """Major number -> access letters that the char-NAME lines allow on this machine."""
    groups = char_groups(proc_devices)
    out: dict[int, set[str]] = {}
    for spec, access in allows:
        if not spec.startswith("char-"):
            continue
        pattern = spec[len("char-"):]
        for major, name in groups:
            if fnmatch.fnmatchcase(name, pattern):
                out.setdefault(major, set()).update(access)
    return out


@dataclass(frozen=True)
class Node:
    path: str
    major: int
    minor: int


def needed_access(node: Node) -> str:
    """What vLLM needs: MIG capability files are opened read-only, every other node rw."""
    return "r" if "/nvidia-caps" in node.path else "rw"


def uncovered(nodes: list[Node], allows: list[tuple[str, str]], proc_devices: str) -> list[str]:
    """One line per node the unit's DeviceAllow= would deny (empty: all covered)."""
    majors = allowed_majors(allows, proc_devices)
    names = {m: [n for mm, n in char_groups(proc_devices) if mm == m] for m, _ in
             char_groups(proc_devices)}
    bad = []
    for node in nodes:
        need = needed_access(node)
        have = majors.get(node.major, set())
        if not set(need) <= have:
            bad.append(f"{node.path} (char {node.major}:{node.minor}, /proc/devices "
                       f"{'/'.join(names.get(node.major, [])) or 'unnamed'}) needs {need}, "
                       f"DeviceAllow gives {''.join(sorted(have)) or 'nothing'}")
    return bad


def nvidia_nodes(dev: Path = Path("/dev")) -> list[Node]:
    """The NVIDIA character devices of this machine: /dev/nvidia* and /dev/nvidia-caps/*."""
    out = []
    for p in sorted(dev.glob("nvidia*")):
        paths = sorted(p.iterdir()) if p.is_dir() and not p.is_symlink() else [p]
        for q in paths:
            st = os.stat(q)
            if stat.S_ISCHR(st.st_mode):
                out.append(Node(str(q), os.major(st.st_rdev), os.minor(st.st_rdev)))
    return out


def shipped_unit(name: str) -> str:
    return (DEBIAN / name).read_text()
