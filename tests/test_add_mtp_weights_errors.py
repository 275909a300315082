"""`mlxmtp add-mtp-weights` on bad input: options refused before any work, in one line; a
broken or half-swapped `mtp/` repaired; a folder that cannot be written never left half-written."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from test_add_mtp_weights import DEAD_PID, _copy, _snapshot

from mlxmtp.checkpoint import mtp_folder
from mlxmtp.checkpoint.tensor_files import read_header
from mlxmtp.commands.add_mtp_weights import add_mtp_weights as cli
from mlxmtp.convert import add_mtp_weights as amw
from mlxmtp.models import errors
from mlxmtp.models import load as L


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _one_line_error(res, *words):
    assert res.exit_code != 0, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1, res.output
    for w in words:
        assert w in error[0], res.output


@pytest.fixture
def no_work(monkeypatch):
    """Fails a test whose command gets as far as loading the model (the conversion's start)."""
    def refuse(*a, **k):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(amw, "load_target", refuse)


@pytest.fixture
def target(tmp_path, fixture_models):
    """A 4-bit affine (group 64) qwen3_5 conversion without head."""
    return _copy(fixture_models["qwen3_5"]["mlx_4bit"], tmp_path / "mlx")


@pytest.fixture
def hf(fixture_models):
    return fixture_models["qwen3_5"]["hf"]


# ------------------------------------------------------------------ an incomplete mtp/ folder

def _break(folder: Path, how: str) -> None:
    if how == "empty":
        shutil.rmtree(folder)
        folder.mkdir()
    elif how == "no_weights":
        (folder / mtp_folder.WEIGHTS).unlink()
    elif how == "cut_weights":
        data = (folder / mtp_folder.WEIGHTS).read_bytes()
        (folder / mtp_folder.WEIGHTS).write_bytes(data[: len(data) // 2])
    elif how == "garbage_weights":
        (folder / mtp_folder.WEIGHTS).write_bytes(b"half a safetensors file")
    else:
        (folder / mtp_folder.CONFIG).write_text('{"format": "mlxmtp-mtp-he')


@pytest.mark.parametrize("how", ["empty", "no_weights", "cut_weights", "garbage_weights", "bad_config"])
def test_incomplete_mtp_folder_is_replaced(target, hf, how):
    assert _run("--model", target, "--source", hf).exit_code == 0
    _break(target / "mtp", how)
    with pytest.raises(errors.MTPLoadError):  # no head, or an unreadable one: "Repair it with ..."
        L.load(str(target))
    res = _run("--model", target, "--source", hf)
    assert res.exit_code == 0, res.output
    assert "incomplete or unreadable" in res.output and "wrote" in res.output
    assert mtp_folder.folder_problem(target / "mtp") is None
    assert L.load(str(target))[0].active
    assert not list(target.glob(".mtp-*"))


def test_read_header_refuses_a_length_past_the_end(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"half a safetensors file")  # read as a header length of ~7e18 bytes
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(f)


# ------------------------------------------------------------------ quantization options

@pytest.mark.parametrize("mode,group,bits", [("mxfp4", 32, 4), ("nvfp4", 16, 4), ("mxfp8", 32, 8)])
def test_fixed_modes_take_their_own_group_size_and_bits(target, hf, mode, group, bits):
    res = _run("--model", target, "--source", hf, "--mode", mode)
    assert res.exit_code == 0, res.output
    assert f"{bits}-bit, group size {group}, mode {mode}" in res.output
    cfg, _ = mtp_folder.read_mtp_folder(target)
    assert {k: cfg["quantization"][k] for k in ("group_size", "bits", "mode")} == \
        {"group_size": group, "bits": bits, "mode": mode}
    model, _ = L.load(str(target))
    fc = model.head.fc
    assert (fc.mode, fc.group_size, fc.bits) == (mode, group, bits)


@pytest.mark.parametrize("args,words", [
    (["--mode", "mxfp4", "--bits", "8", "--group-size", "32"], ["--mode mxfp4", "--bits 8", "requires bits"]),
    (["--mode", "mxfp4", "--group-size", "64"], ["--group-size 64", "requires group size 32"]),
    (["--bits", "8", "--group-size", "16"], ["--group-size 16", "not supported"]),
    (["--group-size", "7"], ["--group-size 7", "not supported"]),
    (["--group-size", "0"], ["--group-size", "positive integer"]),
    (["--group-size", "-5"], ["--group-size", "positive integer"]),
    (["--group-size", "1099511627776"], ["--group-size", "too large"]),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_bad_quantization_options_refused_up_front(target, hf, no_work, args, words, dry_run):
    before = _snapshot(target)
    res = _run("--model", target, "--source", hf, *args, *(["--dry-run"] if dry_run else []))
    _one_line_error(res, *words)
    assert _snapshot(target) == before


def test_library_checks_the_options_too(target, hf, no_work):
    with pytest.raises(amw.AddMTPError, match="--group-size"):
        amw.add_mtp_weights(target, str(hf), group_size=-5, echo=lambda s: None)
    with pytest.raises(amw.AddMTPError, match="--bits"):
        amw.add_mtp_weights(target, str(hf), bits="x", echo=lambda s: None)


# ------------------------------------------------------------------ a source that does not fit

@pytest.mark.parametrize("source", ["qwen3_5_moe", "qwen3_next"])
def test_moe_source_on_dense_target_refused(target, fixture_models, source):
    (target / "mtp").mkdir()  # --force path too: an (empty) head to replace
    before = _snapshot(target)
    res = _run("--model", target, "--source", fixture_models[source]["hf"], "--force")
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    assert "source head is MoE, target model dense" in res.output and "nothing written" in res.output
    assert _snapshot(target) == before


# ------------------------------------------------------------------ a folder that cannot be written

@pytest.fixture
def read_only(monkeypatch, target):
    _make_read_only(monkeypatch, target)


def _make_read_only(monkeypatch, target):
    """MODEL as on a read-only file system (root ignores chmod): no folder can be made in it."""
    real = mtp_folder.tempfile.mkdtemp

    def mkdtemp(*a, dir=None, **k):
        if dir is not None and Path(dir) == target:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(mtp_folder.tempfile, "mkdtemp", mkdtemp)


def test_read_only_model_refused_up_front(target, hf, read_only, no_work):
    res = _run("--model", target, "--source", hf)
    _one_line_error(res, f"cannot write to {target}", os.strerror(errno.EROFS))


def test_read_only_model_dry_run_warns(target, hf, read_only):
    res = _run("--model", target, "--source", hf, "--dry-run")
    assert res.exit_code == 0, res.output
    assert f"warning: cannot write to {target}" in res.output and "would fail" in res.output
    assert not (target / "mtp").exists()


def test_read_only_model_with_its_head_is_nothing_to_do(target, hf, monkeypatch):
    assert _run("--model", target, "--source", hf).exit_code == 0
    _make_read_only(monkeypatch, target)
    res = _run("--model", target, "--source", hf)
    assert res.exit_code == 0 and "nothing to do" in res.output, res.output
    _one_line_error(_run("--model", target, "--source", hf, "--force"), "cannot write to")


@pytest.mark.parametrize("force", [False, True])
def test_disk_error_while_writing_is_one_line(target, hf, monkeypatch, force):
    if force:
        assert _run("--model", target, "--source", hf).exit_code == 0
    before = _snapshot(target)

    def full(path, *a, **k):
        Path(path).write_bytes(b"part of a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(mtp_folder.mx, "save_safetensors", full)
    res = _run("--model", target, "--source", hf, *(["--force", "--bits", "8"] if force else []))
    _one_line_error(res, "cannot write", os.strerror(errno.ENOSPC), "nothing written")
    assert _snapshot(target) == before and not list(target.glob(".mtp-*"))
    monkeypatch.undo()
    if force:  # the previous head is still there and loads
        assert L.load(str(target))[0].head.fc.bits == 4


# ------------------------------------------------------------------ a replacement cut short

def _head_copy(tmp_path, fixture_models, bits) -> Path:
    """A whole `mtp/` folder of `bits` for the qwen3_5 fixture, made elsewhere."""
    other = _copy(fixture_models["qwen3_5"]["mlx_4bit"], tmp_path / f"other{bits}")
    assert _run("--model", other, "--source", fixture_models["qwen3_5"]["hf"], "--bits", bits).exit_code == 0
    return other / "mtp"


@pytest.mark.parametrize("whole_new", [True, False])
def test_swap_killed_between_renames_is_recovered(tmp_path, fixture_models, target, hf, whole_new):
    """What a SIGKILL between the two renames of --force leaves: no mtp/, the old head in
    .mtp-old-PID, the new one in .mtp-tmp-PID-* (whole or not)."""
    assert _run("--model", target, "--source", hf).exit_code == 0  # the old head: 4-bit
    os.replace(target / "mtp", target / f".mtp-old-{DEAD_PID}")
    new = shutil.copytree(_head_copy(tmp_path, fixture_models, 8), target / f".mtp-tmp-{DEAD_PID}-abc")
    if not whole_new:
        (new / mtp_folder.CONFIG).unlink()  # killed before config.json, which comes last
    with pytest.raises(errors.MissingMTPHeadError):
        L.load(str(target))
    before = _snapshot(target)
    res = _run("--model", target, "--source", hf, "--dry-run")
    assert "would restore" in res.output and _snapshot(target) == before
    res = _run("--model", target, "--source", hf)
    assert res.exit_code == 0, res.output
    assert ("its new head" if whole_new else "the previous head") in res.output
    assert "nothing to do" in res.output
    assert not list(target.glob(".mtp-*"))
    assert L.load(str(target))[0].head.fc.bits == (8 if whole_new else 4)


def test_leftovers_removed_when_the_head_is_there(target, hf):
    assert _run("--model", target, "--source", hf).exit_code == 0
    stale = target / f".mtp-tmp-{DEAD_PID}-xyz"
    stale.mkdir()
    (stale / mtp_folder.WEIGHTS).write_bytes(b"half")
    running = target / f".mtp-tmp-{os.getppid()}-xyz"  # a run still going on: not touched
    running.mkdir()
    res = _run("--model", target, "--source", hf)
    assert res.exit_code == 0 and "nothing to do" in res.output, res.output
    assert not stale.exists() and running.exists()


@pytest.fixture(scope="module")
def exited_pid():
    """The PID of a process that has exited (and been reaped): what a killed run leaves in its names."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_killed_force_leaves_old_head_removed_next_run(target, hf, exited_pid):
    """A --force killed after its second rename leaves the previous head in .mtp-old-PID:
    the next run removes it, and only it (names the server does not make are kept)."""
    assert _run("--model", target, "--source", hf).exit_code == 0
    stale = shutil.copytree(target / "mtp", target / f".mtp-old-{exited_pid}")
    running = target / f".mtp-old-{os.getppid()}"  # a run still going on
    theirs = [target / ".mtp-old-backup", target / f".mtp-old-{exited_pid}-mine", target / f".mtp-old-{DEAD_PID}x"]
    for folder in [running, *theirs]:
        shutil.copytree(target / "mtp", folder)
    note = target / f".mtp-tmp-{exited_pid}-notes"  # a file: staging is always a folder
    note.write_text("not ours")
    res = _run("--model", target, "--source", hf, "--force", "--bits", "8")
    assert res.exit_code == 0, res.output
    assert not stale.exists() and stale.name in res.output
    assert running.exists() and note.read_text() == "not ours" and all(f.exists() for f in theirs)
    assert L.load(str(target))[0].head.fc.bits == 8


@pytest.mark.parametrize("force", [False, True])
def test_killed_between_renames_with_only_the_old_head(target, hf, exited_pid, force):
    """Killed between the renames after its staging folder was lost: no mtp/, the previous
    head in .mtp-old-PID only. The next run puts it back (and --force then replaces it)."""
    assert _run("--model", target, "--source", hf).exit_code == 0
    os.replace(target / "mtp", target / f".mtp-old-{exited_pid}")
    with pytest.raises(errors.MissingMTPHeadError, match=f".mtp-old-{exited_pid}"):
        L.load(str(target))
    res = _run("--model", target, "--source", hf, *(["--force", "--bits", "8"] if force else []))
    assert res.exit_code == 0, res.output
    assert "restored the previous head" in res.output and not list(target.glob(".mtp-*"))
    assert L.load(str(target))[0].head.fc.bits == (8 if force else 4)


def test_exception_between_renames_puts_the_old_head_back(target, hf, monkeypatch):
    assert _run("--model", target, "--source", hf).exit_code == 0
    real = os.replace

    def killed(src, dst):
        if Path(src).name.startswith(".mtp-tmp-") and Path(dst).name == "mtp":
            raise KeyboardInterrupt("killed")
        return real(src, dst)

    monkeypatch.setattr(mtp_folder.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        amw.add_mtp_weights(target, str(hf), bits=8, force=True, echo=lambda s: None)
    monkeypatch.undo()
    assert not list(target.glob(".mtp-*"))
    assert L.load(str(target))[0].head.fc.bits == 4


def test_written_folder_marks_itself_whole(tmp_path):
    info = {"num_layers": 1, "expert_layout": "dense", "num_experts": 0, "moe": False}
    cfg = mtp_folder.make_head_config(source="x", family="qwen3_5", info=info, quantization=None, dtype="float32")
    mtp_folder.write_mtp_folder(tmp_path, cfg, {"fc.weight": mx.zeros((2, 4))})
    assert mtp_folder.folder_problem(tmp_path / "mtp") is None
    assert sorted(p.name for p in (tmp_path / "mtp").iterdir()) == [mtp_folder.CONFIG, mtp_folder.WEIGHTS]
    assert json.loads((tmp_path / "mtp" / mtp_folder.CONFIG).read_text())["format"] == mtp_folder.FORMAT


def test_replace_keeps_a_file_it_did_not_make(tmp_path):
    """A file where --force would move the previous head aside is not deleted: the
    replacement fails cleanly and the head stays."""
    info = {"num_layers": 1, "expert_layout": "dense", "num_experts": 0, "moe": False}
    cfg = mtp_folder.make_head_config(source="x", family="qwen3_5", info=info, quantization=None, dtype="float32")
    mtp_folder.write_mtp_folder(tmp_path, cfg, {"fc.weight": mx.zeros((2, 4))})
    theirs = tmp_path / f"{mtp_folder.OLD_PREFIX}{os.getpid()}"
    theirs.write_text("not ours")
    with pytest.raises(OSError):
        mtp_folder.write_mtp_folder(tmp_path, cfg, {"fc.weight": mx.ones((2, 4))}, force=True)
    assert theirs.read_text() == "not ours" and mtp_folder.folder_problem(tmp_path / "mtp") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mtp", theirs.name])


# ------------------------------------------------------------------ --revision

def test_revision_with_local_source_refused(target, hf, no_work):
    res = _run("--model", target, "--source", hf, "--revision", "main")
    assert res.exit_code == 2 and "--revision" in res.output and "local folder" in res.output, res.output
    with pytest.raises(amw.AddMTPError, match="--revision"):
        amw.add_mtp_weights(target, str(hf), revision="main", echo=lambda s: None)
