"""This machine's host memory as the planner budgets it, read from Linux's own accounts.

[Note: host memory that grows]
The planner budgets pinned host memory against what the machine has (`zerofit.plan.choose.Budget`).
`MemTotal` is that on an ordinary machine, and it stays the answer there. Two things make it wrong:
- a cgroup limit below it (a container, a batch job): the limit is what this process may use, so the
  smaller of the two is budgeted;
- memory that is added as it is used. The lent multi-GPU machines (Firecracker VMs) start with a
  `MemTotal` of 31-62 GiB that grows toward a 256-560 GiB limit as memory is touched, about 3 s per
  8 GiB. A guest cannot tell for sure how far it will grow (the host decides), so that memory is not
  budgeted: where Linux shows signs of it - memory blocks offline (present, not yet online), a
  virtio-mem device (memory plugged by the host on request) or a balloon holding pages - the plan's
  text says the figure may be low and names the setting that gives the real one
  (`ZEROFIT_HOST_MEMORY_GIB`), with a cgroup limit above `MemTotal` as the ceiling where one is set.
Under-budgeting costs a slower setting (more offloaded than needed) and a note; over-budgeting costs
a host out-of-memory kill, so the doubt goes to the smaller figure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
UNLIMITED = 2**62
"""cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything this big is none."""
VIRTIO_MEM_DEVICE = "0x0018"
"""The virtio device id of virtio-mem (`/sys/bus/virtio/devices/*/device`)."""


@dataclass(frozen=True)
class HostMemory:
    """What `read_host_memory` found."""

    total_bytes: int | None
    """What the planner budgets: `MemTotal`, or a smaller cgroup limit; None: nothing readable."""
    source: str
    """Where `total_bytes` came from: "MemTotal", "SC_PHYS_PAGES" or the cgroup file that bounds it."""
    growth: tuple[str, ...] = ()
    """The signs that the machine's memory grows as it is used (see [Note: host memory that grows]), each
    a short phrase; empty on an ordinary machine, and where a cgroup limit bounds the budget."""
    ceiling_bytes: int | None = None
    """A cgroup limit above `total_bytes` where memory may grow: the most this process may reach."""

    def note(self, override: str = "ZEROFIT_HOST_MEMORY_GIB") -> str:
        """The plan's note where the figure may be low (empty where not), naming `override`, the setting
        that gives the real figure."""
        if not self.growth or self.total_bytes is None:
            return ""
        ceiling = ("" if self.ceiling_bytes is None
                   else f", up to {self.ceiling_bytes / GIB:.1f} GiB by the cgroup limit")
        return (f"host memory read as {self.total_bytes / GIB:.1f} GiB ({self.source}) may grow as it is used on "
                f"this machine ({'; '.join(self.growth)}{ceiling}): set {override} to the GiB this machine may use "
                "to plan for it")


def read_host_memory(root: str | os.PathLike[str] = "/") -> HostMemory:
    """This machine's host memory under the file system tree `root` (tests pass a fake one), from these
    sources in this order (see [Note: host memory that grows]):
    1. `MemTotal` of `/proc/meminfo` (unreadable, on the real tree: `SC_PHYS_PAGES`);
    2. the cgroup limits of this process's cgroup and each one above it (`/proc/self/cgroup`): cgroup v2
       `memory.max`, v1 `memory.limit_in_bytes`; the smallest finite one replaces `MemTotal` when smaller;
    3. signs that `MemTotal` grows (only said, never counted): memory blocks offline under
       `/sys/devices/system/memory`, a virtio-mem device under `/sys/bus/virtio/devices`, and the pages a
       balloon holds (`Balloon:` of `/proc/meminfo`).
    Never raises: a file missing or malformed is a source that says nothing."""
    base = Path(root)
    lines = meminfo(base)
    total, source = lines.get("MemTotal"), "MemTotal"
    if total is None and base == Path("/"):
        total, source = _sysconf_memory(), "SC_PHYS_PAGES"
    limit = _cgroup_limit(base)
    if limit is not None and (total is None or limit[0] < total):
        return HostMemory(total_bytes=limit[0], source=limit[1])
    growth = _growth_signs(base, lines)
    ceiling = limit[0] if limit is not None and growth else None
    return HostMemory(total_bytes=total, source=source, growth=growth, ceiling_bytes=ceiling)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except (OSError, ValueError):
        return None


def meminfo(root: str | os.PathLike[str] = "/") -> dict[str, int]:
    """`/proc/meminfo` under `root`: its "Name: N kB" lines, in bytes (`MemTotal`, `MemAvailable`, ...);
    empty where it cannot be read. Never raises."""
    out = {}
    for line in (_read(Path(root) / "proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            out[name.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    return out


def _sysconf_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def _cgroup_limit(base: Path) -> tuple[int, str] | None:
    """The smallest finite memory limit over this process's cgroups and their ancestors, and its file."""
    found = []
    for line in (_read(base / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            mounts, name = ("sys/fs/cgroup", "sys/fs/cgroup/unified"), "memory.max"
        elif "memory" in controllers.split(","):
            mounts, name = ("sys/fs/cgroup/memory",), "memory.limit_in_bytes"
        else:
            continue
        for mount in mounts:
            for folder in _self_and_ancestors(base / mount, path):
                value = _read(folder / name)
                if value is not None and value.isdigit() and int(value) < UNLIMITED:
                    found.append((int(value), "/" + str((folder / name).relative_to(base))))
    return min(found) if found else None


def _self_and_ancestors(mount: Path, path: str) -> list[Path]:
    """`mount/path` and every folder above it up to `mount` (a container may see its own cgroup at the mount)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _growth_signs(base: Path, meminfo: dict[str, int]) -> tuple[str, ...]:
    """What says this machine's memory grows as it is used (see `read_host_memory`, source 3)."""
    signs = []
    blocks = base / "sys/devices/system/memory"
    offline = sum(1 for state in blocks.glob("memory*/state") if _read(state) == "offline")
    size = _read(blocks / "block_size_bytes")
    if offline:
        try:
            signs.append(f"{offline} memory blocks offline, {offline * int(size or '', 16) / GIB:.1f} GiB")
        except ValueError:
            signs.append(f"{offline} memory blocks offline")
    if any(_read(d) == VIRTIO_MEM_DEVICE for d in (base / "sys/bus/virtio/devices").glob("*/device")):
        signs.append("a virtio-mem device")
    if meminfo.get("Balloon", 0) > 0:
        signs.append(f"a balloon holding {meminfo['Balloon'] / GIB:.1f} GiB")
    return tuple(signs)
