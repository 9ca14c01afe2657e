"""Damaged, partial or foreign checkpoints raise CheckpointError naming the file; a save that fails part
way (a full disk on one rank, an unstorable value) leaves the previous checkpoint and `latest` intact."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from test_checkpoint_support import build, train

from zerofit.checkpoint import load_state, merge, save_state
from zerofit.errors import CheckpointError, ZerofitError
from zerofit.testing.distributed import run_distributed

FILE_LIMIT = 256 * 1024  # bytes one file may have on the "full disk" of rank 1


def _error_of(fn) -> str | None:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return None


def save_then_fail(rank, world, root):
    case, model, _, engine = build(3)
    train(engine, model, case, rank, world, range(2))
    good = save_state(os.path.join(root, "a"), engine, extra_state={"rank": rank})
    train(engine, model, case, rank, world, range(2, 3))
    out = {"good": good}
    # An unstorable value on one rank: every rank raises, nothing is committed.
    bad = {"rank": rank, "obj": object()} if rank == 1 else {"rank": rank}
    out["unstorable"] = _error_of(lambda: save_state(os.path.join(root, "b"), engine, extra_state=bad))
    # A disk that fills up while rank 1 writes (files beyond FILE_LIMIT fail with EFBIG), both for a new
    # checkpoint and for one that overwrites "a".
    big = {"rank": rank, "blob": torch.zeros(FILE_LIMIT // 2)}
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT // 4, old_limit[1]))
    try:
        out["full_disk_new"] = _error_of(lambda: save_state(os.path.join(root, "c"), engine, extra_state=big))
        out["full_disk_overwrite"] = _error_of(
            lambda: save_state(os.path.join(root, "a"), engine, extra_state=big))
        if rank == 1:  # now too small even for rank 1's share of the model: DCP's write fails
            resource.setrlimit(resource.RLIMIT_FSIZE, (2048, old_limit[1]))
        out["full_disk_tensors"] = _error_of(lambda: save_state(os.path.join(root, "d"), engine))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    out["listing"] = sorted(os.listdir(root))
    # What is left loads, through `latest`, into a fresh engine.
    case, model, _, fresh = build(1, perturb=1.0)
    out["extra"] = load_state(root, fresh)
    return out


@pytest.fixture(scope="module")
def failed_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    return root, run_distributed(save_then_fail, 2, str(root))


def test_failed_saves_leave_previous_checkpoint(failed_saves):
    root, ranks = failed_saves
    for r in ranks:
        assert "rank 1: extra_state['obj'] is a builtins.object" in r["unstorable"]
        assert "File too large" in r["full_disk_new"] or "EFBIG" in r["full_disk_new"], r["full_disk_new"]
        assert r["full_disk_overwrite"] is not None
        text = r["full_disk_tensors"]  # the rank, the file and the cause
        assert text.startswith("rank 1: ") and "shard-00001-model-00001-of-00001.safetensors: writing the sharded " \
            "tensors failed (OSError: [Errno 27] File too large): check the free space" in text, text
        assert r["listing"] == ["a", "latest"]  # no half-written "b" or "c", no temporary directories
    assert (root / "latest").read_text().strip() == "a"
    assert [r["extra"] for r in ranks] == [{"rank": 0}, {"rank": 1}]


@pytest.fixture()
def engine():
    """A one-process engine of the same model (no process group: load_state runs locally)."""
    return build(1, perturb=1.0)[3]


def _damaged(root: Path, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(root / "a", copy)
    return copy


def _state_file(ckpt: Path) -> Path:
    return sorted((ckpt / "state").glob("*.safetensors"))[-1]


def test_flipped_bytes_are_caught(failed_saves, tmp_path, engine):
    ckpt = _damaged(failed_saves[0], tmp_path, "flipped")
    shard = _state_file(ckpt)
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0xFF  # inside the tensor data: safetensors alone would load it silently
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: SHA-256 differs from manifest.json"):
        load_state(ckpt, engine)
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        merge(ckpt, tmp_path / "out")


def test_truncated_file_is_caught(failed_saves, tmp_path, engine):
    ckpt = _damaged(failed_saves[0], tmp_path, "truncated")
    rank_file = ckpt / "rank-00001.json"
    rank_file.write_bytes(rank_file.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"rank-00001.json: 10 bytes, manifest.json says \d+ \(truncated"):
        load_state(ckpt, engine)


def test_missing_rank_file_is_caught(failed_saves, tmp_path, engine):
    ckpt = _damaged(failed_saves[0], tmp_path, "missing")
    shard = _state_file(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: listed in manifest.json but missing"):
        load_state(ckpt, engine)


def test_missing_or_broken_manifest_is_caught(failed_saves, tmp_path, engine):
    ckpt = _damaged(failed_saves[0], tmp_path, "partial")
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json: missing: .* is not a complete zerofit checkpoint"):
        load_state(ckpt, engine)
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: unreadable manifest"):
        load_state(ckpt, engine)


def test_bad_latest_pointer_and_missing_directory(tmp_path, engine):
    (tmp_path / "latest").write_text("step-9\n")
    with pytest.raises(CheckpointError, match=r"latest: names 'step-9', but .* does not exist"):
        load_state(tmp_path, engine)
    (tmp_path / "latest").write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match="not a checkpoint directory name"):
        load_state(tmp_path, engine)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_state(tmp_path / "nope", engine)


def test_a_latest_that_is_not_ours_is_refused_without_echoing_it(tmp_path, engine):
    """#18: a symlink to a file printed that file; a 5 MB or non-UTF-8 pointer crashed or flooded the error."""
    from zerofit.checkpoint.resume import latest_complete

    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2\n")
    (tmp_path / "latest").symlink_to(secret)
    for read in (lambda: load_state(tmp_path, engine), lambda: latest_complete(tmp_path)):
        with pytest.raises(CheckpointError, match="latest is not a regular file") as caught:
            read()
        assert "hunter2" not in str(caught.value)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_bytes(b"x" * 5_000_000)
    with pytest.raises(CheckpointError, match="not a checkpoint directory name") as caught:
        latest_complete(tmp_path)
    assert len(str(caught.value)) < 400
    (tmp_path / "latest").write_bytes(b"\xff\xfe step")
    with pytest.raises(CheckpointError, match="not a checkpoint directory name"):
        load_state(tmp_path, engine)


def test_checkpoint_of_another_model_is_refused(failed_saves, tmp_path):
    from engine_cases import TinyLM

    from zerofit.engine import ZeroEngine

    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    other = ZeroEngine(model, torch.optim.AdamW(model.parameters()), device=torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"saved from a different model \(parameters the model lacks: "
                                              r"\['blocks.2"):
        load_state(failed_saves[0] / "a", other)


def test_common_file_tampering_is_caught(failed_saves, tmp_path, engine):
    ckpt = _damaged(failed_saves[0], tmp_path, "tampered")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "common.json").write_text("[]")
    manifest["files"]["common.json"]["bytes"] = 2
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="common.json: SHA-256 differs"):
        load_state(ckpt, engine)


def test_checkpoint_error_is_an_ordinary_exception():
    assert issubclass(CheckpointError, ZerofitError) and issubclass(CheckpointError, Exception)


def test_files_the_manifest_does_not_list_are_named_and_never_read(failed_saves, tmp_path, engine):
    """#18: load read every *.safetensors in state/: a FIFO blocked it, a stale rank file from another run
    gave 'chunks cover ... does not match this model'."""
    ckpt = _damaged(failed_saves[0], tmp_path, "stale")
    shutil.copy(_state_file(ckpt), ckpt / "state" / "rank-00007.safetensors")
    with pytest.raises(CheckpointError, match=r"rank-00007.safetensors: not in the checkpoint's manifest \(left from "
                                              r"another run"):
        load_state(ckpt, engine)
    (ckpt / "state" / "rank-00007.safetensors").unlink()
    os.mkfifo(ckpt / "state" / "pipe.safetensors")
    with pytest.raises(CheckpointError, match=r"pipe.safetensors: not in the checkpoint's manifest"):
        load_state(ckpt, engine)
    (ckpt / "state" / "pipe.safetensors").unlink()
    load_state(ckpt, engine)  # clean again: loads


def test_a_manifest_is_not_trusted_to_switch_checks_off_or_point_outside(failed_saves, tmp_path, engine):
    """#18: `"files": {}` turned every integrity check off; `../../etc/passwd` entries were followed."""
    ckpt = _damaged(failed_saves[0], tmp_path, "edited")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))
    with pytest.raises(CheckpointError, match=r"manifest.json does not list common.json, state/\*.safetensors, which "
                                              r"every checkpoint holds"):
        load_state(ckpt, engine)
    outside = {**manifest["files"], "../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "files": outside}))
    with pytest.raises(CheckpointError, match=r"lists '../../etc/passwd', a path outside the checkpoint"):
        load_state(ckpt, engine)
    (ckpt / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        load_state(ckpt, engine)


def test_a_save_never_replaces_what_zerofit_did_not_write(tmp_path, engine):
    """#18: save_state on a directory that is not a checkpoint deleted everything in it, exit 0, and
    overwrote a file named `latest` beside it."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work")
    with pytest.raises(CheckpointError, match="exists and is not a zerofit checkpoint .* save to a new or empty"):
        save_state(mine, engine)
    assert (mine / "thesis.txt").read_text() == "years of work" and sorted(p.name for p in tmp_path.iterdir()) == [
        "notes"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        save_state(tmp_path / "file", engine)
    (tmp_path / "latest").write_text("my shopping list\nmilk\n")
    with pytest.raises(CheckpointError, match="zerofit will not overwrite it"):
        save_state(tmp_path / "ckpt", engine)
    assert (tmp_path / "latest").read_text() == "my shopping list\nmilk\n" and not (tmp_path / "ckpt").exists()
    (tmp_path / "latest").unlink()
    (tmp_path / "empty").mkdir()
    save_state(tmp_path / "empty", engine)  # an empty directory, then a checkpoint: both may be replaced
    save_state(tmp_path / "empty", engine)
    assert (tmp_path / "latest").read_text().strip() == "empty"


def test_a_commit_killed_at_any_step_resumes_from_the_newest_complete_copy(tmp_path, engine):
    """#18: a SIGKILL between the two renames of a re-save left `<name>.old-*` and `<name>.tmp-*` and the
    restart refused to start. Each step of the commit is stood in for by the directories it leaves."""
    from zerofit.checkpoint.resume import latest_complete

    def saved(tag: float) -> Path:
        with torch.no_grad():
            for g in engine.groups:
                g.master.fill_(tag)
        return Path(save_state(tmp_path / "src" / f"v{tag}", engine, update_latest=False))

    old, new = saved(1.0), saved(2.0)
    steps = {"before the first rename": ("final:old", "tmp:new"),
             "between the renames": ("old:old", "tmp:new"),
             "after the second rename": ("final:new", "old:old"),
             "only the old copy moved aside": ("old:old",)}
    expect = {"before the first rename": 1.0, "between the renames": 2.0, "after the second rename": 2.0,
              "only the old copy moved aside": 1.0}
    for i, (step, layout) in enumerate(steps.items()):
        root = tmp_path / f"case{i}"
        root.mkdir()
        for item in layout:
            kind, which = item.split(":")
            name = {"final": "ckpt", "tmp": "ckpt.tmp-abc123", "old": "ckpt.old-def456"}[kind]
            shutil.copytree(old if which == "old" else new, root / name)
        (root / "latest").write_text("ckpt\n")
        assert latest_complete(root) == root / "ckpt", step
        load_state(root, engine)
        assert all(float(g.master.flatten()[0]) == expect[step] for g in engine.groups), step



def test_a_full_disk_while_moving_latest_says_the_checkpoint_is_saved_and_leaves_no_stray_file(
        tmp_path, engine, monkeypatch):
    """#40: a full disk while `latest` was written said "committing checkpoint_1 failed" of a checkpoint that
    was complete and loaded, and left `.latest.tmp-*` behind. The disk fills up only in the test: the
    temporary `latest` is created and its write fails with ENOSPC."""
    import errno

    from zerofit.checkpoint import commit

    first = Path(save_state(tmp_path / "checkpoint_0", engine))

    def disk_full(path: Path, data: bytes) -> None:
        path.write_bytes(b"")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(commit, "write_durable", disk_full)
    second = tmp_path / "checkpoint_1"
    with pytest.raises(CheckpointError, match=r"checkpoint_1 is saved and complete .*latest could not be moved to "
                                              r"it \(No space left on device\): latest still names 'checkpoint_0'"):
        save_state(second, engine)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_0", "checkpoint_1", "latest"]
    assert (tmp_path / "latest").read_text().strip() == first.name
    load_state(second, engine)  # what the error says is saved loads


# --- rank files that cannot be parsed, on two ranks (#18) ------------------------------------------
MAX_JSON = 64 << 20  # zerofit.checkpoint.tree.MAX_JSON_BYTES
RANK_FILE_DAMAGE = {
    "deep": (b"[" * 100_000 + b"]" * 100_000, "is nested too deeply to be a zerofit checkpoint file"),
    "deep-but-parsed": (b'{"format": "zerofit-tree/1", "value": ' + b"[" * 900 + b"]" * 900 + b"}",
                        "nested too deeply to be a zerofit checkpoint file"),
    "not-utf8": (b'{"format": "zerofit-tree/1", "value": "\xff\xfe"}', "is not UTF-8 text (byte 39)"),
    "huge": (b'{"format": "zerofit-tree/1", "value": {"rank": 0}}' + b" " * MAX_JSON,
             "is larger than 65536 KiB, which no zerofit checkpoint file is"),
}


def _edit(ckpt: Path, name: str, data: bytes) -> None:
    """Replace `name` and update the manifest to match: an edited (or hand-copied) checkpoint that passes
    the integrity check, so only the reader stands between the file and a traceback."""
    from zerofit.checkpoint.manifest import describe

    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"].update(describe(ckpt, [name]))
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def load_damaged_rank_files(rank, world, root):
    """Save through the Accelerator, then for each damage of rank 0's file: load_state, and an automatic
    resume in a fresh Accelerator (`checkpoint.resume: auto`); every rank reports what it raised."""
    from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

    from zerofit import Accelerator
    from zerofit.config.schema import CheckpointConfig, RunConfig, ZeroConfig
    from zerofit.utils import ProjectConfiguration

    def prepared(mode: str):
        acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2), checkpoint=CheckpointConfig(resume=mode)),
                          project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True))
        torch.manual_seed(0)
        model = TinyLM()
        return acc, *acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    acc, model, opt = prepared("never")
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    acc.backward(loss_fn(model(x), x))
    opt.step()
    ckpt = Path(acc.save_state())
    good = (ckpt / "rank-00000.json").read_bytes()
    out = {}
    for kind, (data, _) in RANK_FILE_DAMAGE.items():
        if rank == 0:
            _edit(ckpt, "rank-00000.json", data)
        acc.wait_for_everyone()
        out[kind] = (_error_of(lambda: acc.load_state(ckpt)), _error_of(lambda: prepared("auto")))
        acc.wait_for_everyone()
    if rank == 0:
        _edit(ckpt, "rank-00000.json", good)
    acc.wait_for_everyone()
    acc.load_state(ckpt)  # whole again: loads
    out["resumed_from"] = prepared("auto")[0].resumed_from
    return out


def test_a_rank_file_that_cannot_be_parsed_is_one_error_on_every_rank(tmp_path):
    """#18: a deeply nested rank-00000.json gave rank 0 a RecursionError traceback while rank 1 waited in the
    next collective (in load_state and in the automatic resume); a 64 MiB one was read whole on every load."""
    ranks = run_distributed(load_damaged_rank_files, 2, str(tmp_path))
    for kind, (_, message) in RANK_FILE_DAMAGE.items():
        for loaded, resumed in (r[kind] for r in ranks):
            for error in (loaded, resumed):
                assert error is not None, kind
                assert error.startswith("rank 0: ") and "rank-00000.json" in error and message in error, error
                assert error.endswith("the checkpoint is damaged or was edited; load an earlier checkpoint"), error
                assert len(error) < 600
        assert ranks[0][kind] == ranks[1][kind]  # the same verdict on both ranks
    assert all(r["resumed_from"].endswith("checkpoint_0") for r in ranks)


def test_a_latest_naming_a_name_too_long_for_the_file_system_is_refused(tmp_path):
    """A 300-character name in `latest` made the automatic resume's look-up raise OSError (ENAMETOOLONG)
    on rank 0 only."""
    from zerofit.checkpoint.resume import choose

    (tmp_path / "latest").write_text("c" * 300 + "\n")
    with pytest.raises(CheckpointError, match=r"latest: names 'c{60}'\.\.\., which is not a checkpoint directory"):
        choose("auto", 1, tmp_path)


# --- the echo cap (#18) ----------------------------------------------------------------------------
def test_a_checkpoint_error_never_echoes_a_huge_value_whole():
    """ConfigError's cap, one rule (zerofit.errors.capped) for both: the start and the fix stay."""
    from zerofit.errors import MAX_PROBLEM_CHARS, ConfigError

    value = "x" * 5_000_000
    error = str(CheckpointError(f"/ckpt/latest: names {value!r}: write a checkpoint name into it"))
    assert len(error) <= MAX_PROBLEM_CHARS and "more characters not shown" in error
    assert error.startswith("/ckpt/latest: names 'xxx") and error.endswith(": write a checkpoint name into it")
    # 200 lines of 10 KB each (2 MB whole) test the same per-line cap and line count as 5 MB lines would,
    # without building a 1 GB string.
    line = "x" * 10_000
    many = str(CheckpointError("\n".join(f"rank {r}: {line}: fix {r}" for r in range(200))))
    assert len(many) < 60 * MAX_PROBLEM_CHARS and many.endswith("... and 150 more problems")
    assert str(CheckpointError(many)) == many  # a verdict re-raised from another's message is unchanged
    assert str(ConfigError([f"zero.stage is {value}: fix it"])).endswith(": fix it")


def test_a_manifest_listing_a_100_kb_name_is_refused_shortly(failed_saves, tmp_path, engine):
    """#18: the name reached the file checks, which raised OSError (File name too long) with it in full."""
    ckpt = _damaged(failed_saves[0], tmp_path, "long-name")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["state/" + "n" * 100_000] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"lists a name of 100006 characters .* longer than any file of a "
                                              r"checkpoint") as caught:
        load_state(ckpt, engine)
    assert len(str(caught.value)) < 600


def load_wrong_shaped_loop_state(rank, world, root):
    """Save through the Accelerator, give rank 0's file a list where the optimizer's loop state (a dict)
    belongs, and load: every rank reports what it raised."""
    from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

    from zerofit import Accelerator
    from zerofit.config.schema import RunConfig, ZeroConfig

    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2)))
    torch.manual_seed(0)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    acc.backward(loss_fn(model(x), x))
    opt.step()
    ckpt = Path(acc.save_state(str(Path(root) / "ckpt")))
    if rank == 0:
        data = json.loads((ckpt / "rank-00000.json").read_text())

        def damage(node):  # every "optimizers" list gets a list where each dict was
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "optimizers" and isinstance(value, list) and value:
                        node[key] = [[1, 2] for _ in value]
                        return True
                    if damage(value):
                        return True
            elif isinstance(node, list):
                return any(damage(v) for v in node)
            return False

        assert damage(data), "no optimizers entry in the rank file"
        _edit(ckpt, "rank-00000.json", json.dumps(data).encode())
    acc.wait_for_everyone()
    error = _error_of(lambda: acc.load_state(str(ckpt)))
    acc.wait_for_everyone()  # no rank is left in a collective
    return error


def test_a_rank_file_of_the_wrong_shape_is_one_error_on_every_rank(tmp_path):
    """#18's leftover: a rank file that parses but holds a list where a dict belongs failed in the loop
    state's restore on rank 0 alone, after the ranks had agreed the files were sound."""
    errors = run_distributed(load_wrong_shaped_loop_state, 2, str(tmp_path))
    assert errors[0] == errors[1] and errors[0] is not None
    assert errors[0].startswith("rank 0: ") and "loop state saved with the checkpoint" in errors[0]
    assert "cannot be restored: TypeError" in errors[0]


def resume_when_choosing_fails(rank, world, root):
    """checkpoint.resume: auto while rank 0's choice raises something unforeseen: what each rank raised."""
    from engine_cases import TinyLM

    from zerofit import Accelerator
    from zerofit.checkpoint import resume
    from zerofit.config.schema import CheckpointConfig, RunConfig, ZeroConfig
    from zerofit.utils import ProjectConfiguration

    def boom(*_args, **_kwargs):
        raise PermissionError("[Errno 13] Permission denied: 'checkpoints/latest'")

    if rank == 0:
        resume.choose = boom
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2), checkpoint=CheckpointConfig(resume="auto")),
                      project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = TinyLM()
    error = _error_of(lambda: acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    acc.wait_for_everyone()  # no rank is left waiting for the decision
    return error


def test_an_unforeseen_failure_choosing_the_checkpoint_is_one_error_on_every_rank(tmp_path):
    """#18's leftover: an exception other than ConfigError/CheckpointError on rank 0 while it picked the
    checkpoint to resume from was raised there alone, and the peers waited for the broadcast."""
    errors = run_distributed(resume_when_choosing_fails, 2, str(tmp_path), timeout=120)
    assert errors[0] == errors[1] and errors[0] is not None
    assert errors[0].startswith("rank 0: choosing the checkpoint to resume from under ")
    assert "PermissionError: [Errno 13] Permission denied" in errors[0]
