"""Several machines without shared storage: a save whose files rank 0 cannot all see fails at the save,
on every rank, naming the files, their hosts and the fix; the previous checkpoint and `latest` stay."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from test_checkpoint_support import build, train

from zerofit.checkpoint import load_state, save_state
from zerofit.checkpoint.visibility import hashed_by, not_shared, unseen
from zerofit.errors import CheckpointError


def _view(root: str, rank: int, target: str) -> None:
    """Make `ckpt`, relative to this rank's own working directory, the real folder `root/target`: two
    machines that each mount a disk of their own at one path see two folders under one name."""
    cwd = Path(root) / f"cwd{rank}"
    cwd.mkdir(exist_ok=True)
    (Path(root) / target).mkdir(exist_ok=True)
    link = cwd / "ckpt"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(Path(root) / target, target_is_directory=True)
    os.chdir(cwd)


def _timed_error(fn) -> tuple[str | None, float]:
    start = time.monotonic()
    try:
        fn()
    except CheckpointError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def save_on_separate_disks(rank, world, root):
    case, model, _, engine = build(1)
    train(engine, model, case, rank, world, range(1))
    _view(root, rank, "shared")
    save_state("ckpt/step_1", engine, extra_state={"rank": rank})
    manifest = (Path(root) / "shared/step_1/manifest.json").read_bytes()
    _view(root, rank, "shared" if rank == 0 else f"local{rank}")
    out = {}
    out["new"] = _timed_error(lambda: save_state("ckpt/step_2", engine, extra_state={"rank": rank}))
    out["replace"] = _timed_error(lambda: save_state("ckpt/step_1", engine, extra_state={"rank": rank}))
    out["step_1_unchanged"] = (Path(root) / "shared/step_1/manifest.json").read_bytes() == manifest
    out["left_here"] = sorted(os.listdir("ckpt"))
    _view(root, rank, "shared")  # the disk every machine sees again: the previous checkpoint loads
    out["extra"] = load_state("ckpt", engine)
    return out


def test_a_save_rank_0_cannot_see_whole_fails_on_every_rank_and_keeps_the_previous_one(tmp_path):
    from zerofit.testing.distributed import run_distributed

    ranks = run_distributed(save_on_separate_disks, 2, str(tmp_path), timeout=60)
    host = socket.gethostname()
    for r in ranks:
        for case in ("new", "replace"):
            error, seconds = r[case]
            assert error is not None and seconds < 10, (case, seconds)
            assert f"rank 0 (host {host}), which writes the checkpoint's manifest, cannot see 2 of the files" in error
            assert f"2 written on host {host} (rank 1): rank-00001.json, state/shard-" in error
            assert "Save to a directory every machine mounts (NFS, Lustre" in error
            assert "checkpoint.use_node_local_storage is accepted and ignored" in error
            assert "Nothing was committed" in error
        assert r["step_1_unchanged"]
        assert r["extra"] == {"rank": ranks.index(r)}
    assert (tmp_path / "shared/latest").read_text().strip() == "step_1"
    assert ranks[0]["left_here"] == ["latest", "step_1"]  # no step_2, no temporary directory
    assert ranks[1]["left_here"] == []  # rank 1 cleared its own machine's half too


def test_rank_0_looks_up_by_name_what_its_listing_missed(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state/shard-2.safetensors").write_bytes(b"12345")
    (tmp_path / "rank-1.json").write_bytes(b"{}")
    views = [{"common.json": 9},  # a stale listing that missed the other files, which are there
             {"common.json": 9, "state/shard-2.safetensors": 5, "rank-1.json": 2},
             {"state/shard-2.safetensors": 4, "rank-2.json": 2}]
    assert unseen(tmp_path, views) == {2: ["rank-2.json", "state/shard-2.safetensors"]}
    assert unseen(tmp_path, views[:2]) == {}
    shares = [hashed_by(views[:2], r) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == ["common.json", "rank-1.json", "state/shard-2.safetensors"]
    assert "rank-1.json" in shares[1] and "state/shard-2.safetensors" in shares[1]  # rank 0 never listed them
    same = {"a": 1, "b": 2, "c": 3}
    assert [hashed_by([same, None, None], r) for r in range(3)] == [["a"], ["b"], ["c"]]


def test_the_error_groups_files_by_host_and_shows_a_few():
    missing = {r: [f"rank-{r}.json", f"state/shard-{r}.safetensors"] for r in range(4, 8)}
    text = not_shared(Path("/ckpt/step_9"), ["n0"] * 4 + ["n1"] * 4, missing)
    assert "cannot see 8 of the files" in text
    assert "8 written on host n1 (ranks 4, 5, 6, 7): rank-4.json, state/shard-4.safetensors, rank-5.json, ..." \
        in text
    assert "Nothing was committed: step_9 and the `latest` beside it are as they were" in text
