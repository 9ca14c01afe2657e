"""Whether the rank that writes the manifest sees every file the other ranks wrote, before it commits.

[Note: one directory every rank sees]
A checkpoint's files come from every rank, its manifest and commit from rank 0 alone. On several
machines the checkpoint directory must therefore be one folder all of them see (NFS, Lustre, a cloud
file share). Machines that each mount a disk of their own at the same path write two halves of one
checkpoint instead, and a manifest written from one half names files that are not there: the save
would "succeed" and the error come only at the next load, after the previous checkpoint was replaced.

So, after every rank has written and before anything is hashed, each rank lists the temporary
directory as it sees it, names with sizes (`view`), and the ranks compare digests of their lists (one
small all-gather). Equal digests, the shared-storage case, end the check. A rank whose list differs
sends it whole, and rank 0 looks each of its files up by name (`unseen`): one it cannot find, or finds
at another size, fails the save on every rank before the commit (`not_shared`), naming the hosts. A
lookup by name, unlike a directory listing, is what a network file system answers from the server for
a file this client has not seen before, so a listing that is merely stale does not fail a save.

zerofit writes no node-local checkpoints: one loads at any world size because every rank can read
every shard. DeepSpeed's `checkpoint.use_node_local_storage` is accepted and ignored (with a warning,
`zerofit.config.ignored`), and the error says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

from zerofit.checkpoint.manifest import list_files
from zerofit.checkpoint.ranks import Ranks

_SHOWN_HOSTS = 8
_SHOWN_FILES = 3


def confirm(tmp: Path, final: Path, ranks: Ranks) -> list[str]:
    """Collective: check that rank 0 sees every file any rank sees under `tmp` (the save of `final`), else
    raise the same CheckpointError on every rank; returns the files this rank hashes for the manifest."""
    error, seen = None, {}
    try:
        seen = view(tmp)
    except Exception as e:  # any failure must reach the all-gather, or the peers would wait forever
        error = f"rank {ranks.rank}: listing {tmp} failed: {e}"
    heads = ranks.all_gather((error, socket.gethostname(), digest(seen)))
    ranks.raise_any([e for e, _, _ in heads])
    if all(d == heads[0][2] for *_, d in heads):  # one shared directory: the only cost is that all-gather
        return sorted(seen)[ranks.rank::ranks.world]
    differs = ranks.is_main or heads[ranks.rank][2] != heads[0][2]
    views = ranks.all_gather(seen if differs else None)
    if ranks.is_main:
        missing = unseen(tmp, views)
        error = not_shared(final, [h for _, h, _ in heads], missing) if missing else None
    ranks.agree(error)
    return hashed_by(views, ranks.rank)


def view(directory: Path) -> dict[str, int]:
    """{name: bytes} of every file under `directory` as this rank sees it (the manifest's names; stat only)."""
    if not directory.is_dir():
        return {}
    return {name: (directory / name).stat().st_size for name in list_files(directory)}


def digest(seen: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(seen.items())).encode()).hexdigest()


def unseen(directory: Path, views: list[dict[str, int] | None]) -> dict[int, list[str]]:
    """On rank 0: {rank: the files of its view that rank 0 cannot find, or finds at another size, under
    `directory`}. `views[0]` is rank 0's own view; None: a rank whose view equals rank 0's."""
    mine = views[0] or {}
    looked_up: dict[str, int | None] = {}
    found: dict[int, list[str]] = {}
    for rank, seen in enumerate(views[1:], start=1):
        for name, size in sorted((seen or {}).items()):
            if mine.get(name) == size:
                continue
            if name not in looked_up:
                try:
                    looked_up[name] = os.stat(directory / name).st_size
                except OSError:  # absent (or unreadable): either way not a file this manifest may name
                    looked_up[name] = None
            if looked_up[name] != size:
                found.setdefault(rank, []).append(name)
    return found


def not_shared(final: Path, hosts: list[str], missing: dict[int, list[str]]) -> str:
    """The error for files rank 0 cannot see: how many, on which hosts and ranks, and the fix."""
    by_host: dict[str, tuple[list[int], dict[str, None]]] = {}
    for rank, names in sorted(missing.items()):
        ranks, files = by_host.setdefault(hosts[rank], ([], {}))
        ranks.append(rank)
        files.update(dict.fromkeys(names))
    total = len({n for names in missing.values() for n in names})
    lines = [f"{final}: rank 0 (host {hosts[0]}), which writes the checkpoint's manifest, cannot see {total} of the "
             "files the other ranks wrote into it: the ranks are saving into different folders under one path (each "
             "machine's own disk), so the checkpoint would name files it does not hold"]
    for host, (ranks, files) in list(by_host.items())[:_SHOWN_HOSTS]:
        shown = ", ".join(list(files)[:_SHOWN_FILES]) + (", ..." if len(files) > _SHOWN_FILES else "")
        lines.append(f"  {len(files)} written on host {host} (rank{'s' if len(ranks) > 1 else ''} "
                     f"{', '.join(map(str, ranks))}): {shown}")
    if len(by_host) > _SHOWN_HOSTS:
        lines.append(f"  and files on {len(by_host) - _SHOWN_HOSTS} more hosts")
    lines.append("Save to a directory every machine mounts (NFS, Lustre, a cloud file share); zerofit writes no "
                 "node-local checkpoints (DeepSpeed's checkpoint.use_node_local_storage is accepted and ignored). "
                 f"Nothing was committed: {final.name} and the `latest` beside it are as they were")
    return "\n".join(lines)


def hashed_by(views: list[dict[str, int] | None], rank: int) -> list[str]:
    """The files `rank` hashes for the manifest: every file some rank sees (`views[0]` is rank 0's; None
    stands for it), each by one of the ranks that see it, in turn, so no rank opens a file it cannot see."""
    own = [v if v is not None else views[0] for v in views]
    mine = []
    for i, name in enumerate(sorted(set().union(*own))):
        holders = [r for r, v in enumerate(own) if name in v]
        if holders[i % len(holders)] == rank:
            mine.append(name)
    return mine
