"""The doctor on real directories (run directory, caches, unreadable data), and the path probes
it shares with scripts/check_scenarios.py (train/paths.py). Its GPU checks: test_doctor_gpu.py.

Tests run as root, which writes and reads everything: denial comes from a read-only bind mount
in a private mount namespace (unshare --mount), or from running the doctor without the
CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH capabilities (setpriv), so that file modes apply to root
as to anyone. A test skips when this host allows neither, after checking that the denial holds.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from train import doctor, paths
from train.run_dirs import MARKER

ROOT = Path(__file__).resolve().parent.parent
DROP_DAC = "-dac_override,-dac_read_search"


def write_config(tmp_path: Path, data_root: Path, *, task: str = "ocr", **extra: str) -> Path:
    """A standalone config (no extends), CPU, no workers, runs under tmp_path/runs."""
    if task == "ocr":
        data = f"  train: {data_root / 'train'}\n  char_dict: {data_root / 'charset.txt'}\n"
        data += "  image_shape: [3, 32, 160]\n  max_text_length: 10\n"
    else:
        data = f"  train: {data_root}\n"
    data += "".join(f"  {key}: {value}\n" for key, value in extra.items())
    text = (
        f"task: {task}\nframework: paddle\ndata:\n{data}"
        "loader:\n  batch_size: 8\n  num_workers: 0\n"
        "train:\n  device: cpu\n"
        f"output:\n  dir: {tmp_path / 'runs'}/{{config_name}}\n"
    )
    path = tmp_path / "doctor.yaml"
    path.write_text(text)
    return path


def doctor_cmd(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "train.doctor", "--config", str(config), *args]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def without_dac(cmd: list[str], probe: Path) -> list[str]:
    """``cmd`` run so that file modes deny it: as root, without the DAC-override capabilities.
    ``probe`` is a directory of mode 0555 that must then refuse a new file (else skip)."""
    if os.getuid() != 0:
        prefix = []
    elif shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop root's DAC capabilities")
    else:
        prefix = ["setpriv", f"--inh-caps={DROP_DAC}", f"--bounding-set={DROP_DAC}"]
    check = run([*prefix, "sh", "-c", f"touch {shlex.quote(str(probe / '.probe'))}"])
    if check.returncode == 0:
        (probe / ".probe").unlink()
        pytest.skip("file modes do not deny writes here")
    return [*prefix, *cmd]


def in_read_only_mount(cmd: list[str], directory: Path) -> list[str]:
    """``cmd`` run in a private mount namespace where ``directory`` is bind-mounted read-only."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    quoted = shlex.quote(str(directory))
    mount = f"mount --bind -o ro {quoted} {quoted}"
    check = run(["unshare", "--mount", "sh", "-c", f"{mount} && touch {quoted}/.probe"])
    if "Read-only file system" not in check.stderr:
        pytest.skip(f"no private read-only bind mount here: {check.stderr.strip()[:200]}")
    return ["unshare", "--mount", "sh", "-c", f"{mount} && exec {shlex.join(cmd)}"]


def line(output: str, name: str) -> str:
    """The check line of ``name`` and its fix line, if any, with runs of spaces made one (the
    column width depends on which checks ran)."""
    lines = output.splitlines()
    for i, text in enumerate(lines):
        if text[6:].startswith(name + " "):
            fix = lines[i + 1] if i + 1 < len(lines) and "fix: " in lines[i + 1] else ""
            return " ".join(f"{text} {fix}".split())
    raise AssertionError(f"no {name!r} line in:\n{output}")


def owner_and_mode(path: Path) -> str:
    st = path.stat()
    return f"owner {st.st_uid}:{st.st_gid}, mode {stat.filemode(st.st_mode)}"


# ---------------------------------------------------------------- run directory
def test_run_dir_on_a_read_only_mount_fails_with_owner_mode_uid_and_fix(tmp_path, ocr_lmdb):
    config = write_config(tmp_path, ocr_lmdb.parent)
    runs = tmp_path / "runs"
    runs.mkdir()
    result = run(in_read_only_mount(doctor_cmd(config), runs))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    text = line(result.stdout, "output dir")
    assert text.startswith("FAIL") and f"{runs}/doctor: cannot create a directory in {runs}" in text
    assert "Read-only file system" in text and owner_and_mode(runs) in text
    assert f"we are uid {os.getuid()} gid {os.getgid()}" in text
    assert "fix: " in text and "--output-dir somewhere writable" in text
    assert "doctor: 1 FAIL" in result.stdout and "(output dir)" in result.stdout
    # The same mount, with --output-dir elsewhere: the run directory training would use passes.
    elsewhere = tmp_path / "elsewhere" / "run"
    result = run(in_read_only_mount(doctor_cmd(config, "--output-dir", str(elsewhere)), runs))
    assert result.returncode == 0, result.stdout + result.stderr
    assert line(result.stdout, "output dir").startswith(f"PASS output dir {elsewhere}: writable")


def test_run_dir_owned_by_another_user_fails_with_run_as_owner_fix(tmp_path, ocr_lmdb):
    config = write_config(tmp_path, ocr_lmdb.parent)
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o555)
    runs.chmod(0o555)
    result = run(without_dac(doctor_cmd(config), runs))
    assert result.returncode == 1, result.stdout + result.stderr
    text = line(result.stdout, "output dir")
    assert text.startswith("FAIL") and "Permission denied" in text
    assert f"{owner_and_mode(runs)} (0555)" in text
    assert f"we are uid {os.getuid()}" in text
    assert "fix: run as the owner (HOST_UID=$(id -u) in compose), or chown " in text
    assert text.endswith("or --output-dir somewhere writable")
    assert not (runs / "doctor").exists()


def test_run_dir_whose_checkpoints_belong_to_another_user_fails(tmp_path, ocr_lmdb):
    """An earlier run as root left checkpoints/ that this user cannot write: training would die
    at its first checkpoint, so the doctor says so now."""
    config = write_config(tmp_path, ocr_lmdb.parent)
    checkpoints = tmp_path / "runs" / "doctor" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints.parent / MARKER).write_text("{}")  # a run directory, as training marks it
    checkpoints.chmod(0o555)
    result = run(without_dac(doctor_cmd(config), checkpoints))
    text = line(result.stdout, "output dir")
    assert result.returncode == 1 and text.startswith("FAIL"), result.stdout
    assert f"cannot write {checkpoints}: Permission denied" in text
    assert f"chown -R {os.getuid()}:{os.getgid()} {checkpoints.parent}" in text


def test_output_dir_option_is_honoured_and_leaves_no_trace(tmp_path, ocr_lmdb, capsys):
    config = write_config(tmp_path, ocr_lmdb.parent)
    target = tmp_path / "other" / "deeper" / "run"
    assert doctor.main(["--config", str(config), "--output-dir", str(target)]) == 0
    out = capsys.readouterr().out
    text = line(out, "output dir")
    assert text.startswith(f"PASS output dir {target}: writable (missing: training")
    # Free space measured in the run directory, not at '.'
    assert f"free at {target}; checkpoints need" in line(out, "disk for checkpoints")
    # The directories made for the probe are gone again; the config's output.dir was not used.
    assert not (tmp_path / "other").exists() and not (tmp_path / "runs").exists()
    # Without --output-dir: output.dir of the config
    assert doctor.main(["--config", str(config)]) == 0
    assert f"{tmp_path / 'runs' / 'doctor'}: writable" in capsys.readouterr().out


def test_resume_flags_are_accepted_and_resume_needs_a_checkpoint(tmp_path, ocr_lmdb, capsys):
    config = write_config(tmp_path, ocr_lmdb.parent)
    assert doctor.main(["--config", str(config), "--auto-resume"]) == 0
    capsys.readouterr()
    assert doctor.main(["--config", str(config), "--resume"]) == 1
    text = line(capsys.readouterr().out, "output dir")
    assert "--resume but it holds no checkpoint" in text and "fix: drop --resume" in text
    step = tmp_path / "runs" / "doctor" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (tmp_path / "runs" / "doctor" / MARKER).write_text("{}")
    (step / "trainer.json").write_text("{}")
    assert doctor.main(["--config", str(config), "--resume"]) == 0
    assert "holds a run (latest step-00000010)" in capsys.readouterr().out


# ---------------------------------------------------------------- a finished run's data wait
def finished_run(tmp_path: Path, **summary) -> Path:
    run = tmp_path / "finished"
    run.mkdir()
    (run / MARKER).write_text("{}")  # a run directory, as training marks it
    (run / "summary.json").write_text(json.dumps({"steps": 10, **summary}))
    return run


def test_run_dir_warns_on_a_data_wait_above_stall_warn_fraction(tmp_path, ocr_lmdb, capsys):
    """The run's own sentence and tuner command (its scenario and --set items) in the WARN;
    a WARN, so the doctor still exits 0."""
    config = write_config(tmp_path, ocr_lmdb.parent)
    run = finished_run(
        tmp_path,
        data_wait_fraction=0.45,
        loader_bottleneck="the 1 loader worker was busy 98% of the time.",
        loader_tune="python -m train.tune --config configs/ocr/smoke.yaml --set a=1",
    )
    assert doctor.main(["--config", str(config), "--run-dir", str(run)]) == 0
    text = line(capsys.readouterr().out, "last run's data wait")
    assert text.startswith(f"WARN last run's data wait {run}: the steps waited on data 45% ")
    assert "(train.stall_warn_fraction 30%); the 1 loader worker was busy 98%" in text
    assert "fix: python -m train.tune --config configs/ocr/smoke.yaml --set a=1 (finds" in text
    # Below the config's own threshold: PASS, no fix
    args = ["--config", str(config), "--run-dir", str(run)]
    assert doctor.main([*args, "--set", "train.stall_warn_fraction=0.5"]) == 0
    text = line(capsys.readouterr().out, "last run's data wait")
    assert text.startswith("PASS") and "fix:" not in text
    # Without --run-dir the check is not made
    assert doctor.main(["--config", str(config)]) == 0
    assert "last run's data wait" not in capsys.readouterr().out


def test_run_dir_of_an_older_or_unfinished_run(tmp_path, ocr_lmdb, capsys):
    """A summary without the tuner's command (written before the summary had one): the fix is
    the command for the config checked. No summary (the run did not finish): a WARN naming it."""
    config = write_config(tmp_path, ocr_lmdb.parent)
    run = finished_run(tmp_path, data_wait_fraction=0.6)
    assert doctor.main(["--config", str(config), "--run-dir", str(run)]) == 0
    text = line(capsys.readouterr().out, "last run's data wait")
    assert text.startswith("WARN") and f"fix: python -m train.tune --config {config} " in text
    (run / "summary.json").unlink()
    assert doctor.main(["--config", str(config), "--run-dir", str(run)]) == 0
    text = line(capsys.readouterr().out, "last run's data wait")
    assert text.startswith(f"WARN last run's data wait {run / 'summary.json'}: missing")


def test_run_dir_alone_checks_that_runs_config_and_directory(tmp_path, ocr_lmdb, capsys):
    from train.config.load import load_config, save_resolved

    run = finished_run(tmp_path, data_wait_fraction=0.35)
    save_resolved(load_config(write_config(tmp_path, ocr_lmdb.parent)), run)
    assert doctor.main(["--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert line(out, "output dir").startswith(f"PASS output dir {run}: writable")
    text = line(out, "last run's data wait")
    assert f"fix: python -m train.tune --config {run / 'config.resolved.yaml'} " in text
    with pytest.raises(SystemExit) as exited:  # neither --config nor --run-dir
        doctor.main([])
    assert exited.value.code == 2


# ---------------------------------------------------------------- caches
def test_cache_dirs_are_checked_only_when_used(tmp_path, ocr_lmdb, capsys):
    cache, remote = tmp_path / "cache" / "data", tmp_path / "cache" / "remote"
    config = write_config(
        tmp_path, ocr_lmdb.parent, cache="memory", cache_dir=cache, remote_cache_dir=remote
    )
    assert doctor.main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "data.cache_dir" not in out and "data.remote_cache_dir" not in out
    args = ["--config", str(config), "--set", "data.cache=disk", "--set", "data.val=s3://b/val"]
    assert doctor.main(args) == 0
    out = capsys.readouterr().out
    assert line(out, "data.cache_dir").startswith(f"PASS data.cache_dir {cache}: writable")
    assert line(out, "data.remote_cache_dir").startswith(
        f"PASS data.remote_cache_dir {remote}: writable"
    )
    assert not (tmp_path / "cache").exists()  # probed, then removed again


def test_unwritable_cache_dirs_fail_with_fix(tmp_path, ocr_lmdb):
    volume = tmp_path / "cache"
    volume.mkdir()
    config = write_config(
        tmp_path,
        ocr_lmdb.parent,
        cache="disk",
        cache_dir=volume / "data",
        remote_cache_dir=volume / "remote",
        val="s3://bucket/ocr/val",
    )
    result = run(in_read_only_mount(doctor_cmd(config), volume))
    assert result.returncode == 1, result.stdout + result.stderr
    disk = line(result.stdout, "data.cache_dir")
    assert disk.startswith(f"FAIL data.cache_dir {volume / 'data'}: cannot create")
    assert "Read-only file system" in disk and owner_and_mode(volume) in disk
    assert "set data.cache_dir to a writable directory (or data.cache: none)" in disk
    staged = line(result.stdout, "data.remote_cache_dir")
    assert staged.startswith("FAIL") and "set data.remote_cache_dir to a writable" in staged
    assert line(result.stdout, "output dir").startswith("PASS")


# ---------------------------------------------------------------- unreadable data
@pytest.mark.parametrize("what", ["lmdb_dir", "data_mdb", "char_dict", "parent", "hdf5"])
def test_unreadable_data_fails_naming_the_path_not_a_traceback(what, tmp_path, ocr_lmdb, image_h5):
    data = tmp_path / "data"
    if what == "hdf5":
        data.mkdir()
        shutil.copy(image_h5, data / "train.h5")
        config = write_config(tmp_path, data / "train.h5", task="classification")
        denied = data / "train.h5"
    else:
        shutil.copytree(ocr_lmdb.parent, data)
        config = write_config(tmp_path, data)
        denied = {
            "lmdb_dir": data / "train",
            "data_mdb": data / "train" / "data.mdb",
            "char_dict": data / "charset.txt",
            "parent": data,
        }[what]
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    probe.chmod(0o555)
    cmd = without_dac(doctor_cmd(config), probe)
    denied.chmod(0)
    try:
        result = run(cmd)
    finally:
        denied.chmod(0o755)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    text = line(result.stdout, "data.train")
    action = {"lmdb_dir": "list", "parent": "enter"}.get(what, "read")
    assert text.startswith("FAIL") and f"cannot {action} {denied}: Permission denied" in text
    assert "(0000)" in text and f"we are uid {os.getuid()}" in text
    assert f"fix: make it readable for uid {os.getuid()} (on the host: chmod " in text
    assert "HOST_UID=$(id -u)" in text and "point data.train at a readable copy" in text


# ---------------------------------------------------------------- the shared probes
def test_write_problem_creates_like_mkdir_p_then_leaves_no_trace(tmp_path):
    assert paths.write_problem(tmp_path / "a" / "b" / "c") is None
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    blocker.chmod(0o644)
    problem = paths.write_problem(blocker / "run")
    assert problem.startswith(f"{blocker / 'run'}: cannot use {blocker}: exists and is not a dir")
    assert f"(0644); we are uid {os.getuid()} gid {os.getgid()})" in problem


def test_read_problem_names_what_refused_and_leaves_missing_to_the_caller(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "data.mdb").write_bytes(b"x")
    assert paths.read_problem(data) is None
    assert paths.read_problem(tmp_path / "missing" / "train") is None
    problem = paths.read_problem(data / "data.mdb" / "train")
    assert problem.startswith(f"{data / 'data.mdb' / 'train'}: cannot enter {data / 'data.mdb'}")
    assert "Not a directory" in problem and "we are uid" in problem


def test_check_scenarios_reports_an_unwritable_run_dir_and_missing_data(tmp_path):
    config = write_config(tmp_path, tmp_path / "nowhere")
    runs = tmp_path / "runs"
    runs.mkdir()
    script = [sys.executable, "-m", "scripts.check_scenarios", str(config)]
    result = run(in_read_only_mount(script, runs))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"data.train: {tmp_path / 'nowhere' / 'train'} does not exist" in result.stdout
    assert (
        f"output.dir: {runs / 'doctor'}: cannot create a directory in {runs}: Read-only file "
        f"system ({runs}: owner"
    ) in result.stdout
    assert "0 of 1 scenarios ready here" in result.stdout
