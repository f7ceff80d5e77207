"""Multi-process training under torchrun (gloo on CPU): clean exits on success and one clear line on failure."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "NMT_NO_TCMALLOC": "1", "NMT_DEBUG": "0", "PYTHONUNBUFFERED": "1"}
ENV.pop("MULTI30K_DIR", None)
OUR_TRACEBACK = re.compile(r'File "[^"]*(train_transformer|data_preparation|evaluation|checkpoint)\.py"')

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("torchrun") is None and sys.platform != "linux",
                                                   reason="needs torch.distributed.run")]


def torchrun(run: Path, prepared: Path, *extra: str, timeout: float = 300, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, "train_transformer.py", "--config", "configs/tiny.yaml", f"train.out_dir={run}",
                           f"data.prepared_dir={prepared}", "decode.max_len_a=0", "decode.max_len_b=6", *extra],
                          cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout)


def finalization_probe(folder: Path) -> dict:
    """An environment whose Python processes write folder/finalized.RANK when the interpreter finalizes (an
    atexit hook from sitecustomize): a training rank must never get there (train_transformer.run_rank)."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "if 'RANK' in os.environ:\n"
        f"    atexit.register(lambda: open(os.path.join({str(folder)!r}, 'finalized.' + os.environ['RANK']), 'w'))\n")
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(folder), ENV.get("PYTHONPATH", "")])}


def test_two_processes_finish_cleanly_five_times_in_a_row(tmp_path):
    """The final report runs on rank 0 after every rank left the process group: exit 0, no traceback, one
    results.json (before, 2 of 4 runs ended with rank 1 aborting and torchrun exiting 1). No rank finalizes the
    interpreter, where gloo's leftover threads once made a finished rank abort in CI."""
    env = finalization_probe(tmp_path / "probe")
    for i in range(5):
        run = tmp_path / f"run{i}"
        proc = torchrun(run, tmp_path / "prepared", env=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out and "terminate called" not in out and "SIGTERM" not in out, out[-3000:]
        assert out.count("results: ") == 1 and (run / "results.json").is_file()
        assert "2 process(es)" in out
    assert not list((tmp_path / "probe").glob("finalized.*"))


def test_a_rank_ends_with_its_output_and_exit_status():
    """run_rank leaves with os._exit: what the rank printed to a pipe (block-buffered) still arrives, and the
    exit status is the one cli_main chose (argparse's 0 for --help, 2 for a user error)."""
    env = {key: value for key, value in ENV.items() if key != "PYTHONUNBUFFERED"} | {"WORLD_SIZE": "2", "RANK": "0"}
    help_ = subprocess.run([sys.executable, "train_transformer.py", "--help"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "usage: train_transformer.py" in help_.stdout, help_.stderr[-2000:]
    bad = subprocess.run([sys.executable, "train_transformer.py", "--config", "no/such.yaml"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no/such.yaml" in bad.stderr, bad.stderr[-2000:]


def slow_rank0(folder: Path) -> dict:
    """An environment whose rank 0 starts 3 s after the other ranks (a sleep in sitecustomize)."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n")
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(folder), ENV.get("PYTHONPATH", "")])}


def root_cause_rank(torchrun_stderr: str) -> int:
    """The rank that torchrun's failure report names as the root cause."""
    return int(re.search(r"Root Cause.*?rank\s*:\s*(\d+)", torchrun_stderr, re.S).group(1))


def test_bad_override_fails_once_with_one_line(tmp_path):
    """Every rank finds the bad value, rank 0 says it even when it is the slowest to start (in CI rank 1 once left
    first, torchrun stopped rank 0 before it said anything and named the silent rank 1 as the cause)."""
    proc = torchrun(tmp_path / "run", tmp_path / "prepared", "train.warmup=0", env=slow_rank0(tmp_path / "slow"))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: train.warmup must be >= 1 (the schedule of eq. 3 divides by it)"], proc.stderr[-3000:]
    assert not OUR_TRACEBACK.search(proc.stderr), proc.stderr[-3000:]
    assert root_cause_rank(proc.stderr) == 0, proc.stderr[-3000:]


def test_setup_error_on_every_rank_is_reported_once(tmp_path):
    """A run dir that already holds a run: every rank finds it, rank 0 alone says so, nobody hangs."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    proc = torchrun(run, tmp_path / "prepared", timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "already holds a run" in errors[0], proc.stderr[-3000:]
    assert not OUR_TRACEBACK.search(proc.stderr), proc.stderr[-3000:]
    assert root_cause_rank(proc.stderr) == 0, proc.stderr[-3000:]


def start_job(run: Path, prepared: Path, eval_every: int, env: dict = ENV) -> subprocess.Popen:
    """A 2-process torchrun of the tiny config with no end in sight, returned once training is under way (past
    its first evaluation: checkpoint_last.pt exists). The caller ends it, and calls kill_job in a finally."""
    cmd = [*TORCHRUN, "train_transformer.py", "--config", "configs/tiny.yaml", f"train.out_dir={run}",
           f"data.prepared_dir={prepared}", "train.max_steps=100000", f"train.eval_every={eval_every}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "checkpoint_last.pt").exists():
        if time.time() > deadline or proc.poll() is not None:
            kill_job(proc, run)
            raise AssertionError("training did not start")
        time.sleep(0.2)
    return proc


def signal_rank_1(proc: subprocess.Popen, run: Path, signum: int, timeout: float) -> str:
    """Sends signum to rank 1 of the job alone; returns the job's stderr once it has ended (killed after timeout)."""
    try:
        pid = rank_pid(run, 1)
        assert pid is not None
        os.kill(pid, signum)
        return proc.communicate(timeout=timeout)[1]
    finally:
        kill_job(proc, run)


def kill_job(proc: subprocess.Popen, run: Path) -> None:
    """SIGKILL to torchrun and to its ranks (each in a session of its own), so that a hung job leaves no process
    behind to slow the rest of the suite."""
    proc.kill()
    for pid in (rank_pid(run, 0), rank_pid(run, 1)):
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it may end between the two lines
                os.kill(pid, signal.SIGKILL)


def rank_pid(run: Path, local_rank: int) -> int | None:
    """PID of the training process of local_rank whose command line names run."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"train.out_dir={run}".encode() in cmdline and f"LOCAL_RANK={local_rank}".encode() in environ \
                and any(arg.endswith(b"train_transformer.py") for arg in cmdline):
            return int(entry.name)
    return None


def test_killed_rank_ends_the_job_with_one_line(tmp_path):
    """SIGKILL one rank mid-training: the job ends non-zero within the timeout, rank 0 says in one line that it
    lost the other process, and no Python traceback of ours is printed."""
    run = tmp_path / "run"
    proc = start_job(run, tmp_path / "prepared", eval_every=20)
    err = signal_rank_1(proc, run, signal.SIGKILL, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "lost contact with the other training processes" in errors[0], err[-3000:]
    assert "checkpoint_last.pt (step" in errors[0]
    assert not OUR_TRACEBACK.search(err), err[-3000:]


def test_sigterm_stops_every_rank_at_the_same_step_and_resumes(tmp_path):
    """SIGTERM to torchrun (what a scheduler sends): the ranks agree on the step, rank 0 saves it, every rank
    leaves together; a torchrun --resume then continues from that step and ends cleanly. Neither run's ranks
    finalize the interpreter (the resumed run's rank 1 once aborted there, in CI)."""
    run, prepared = tmp_path / "run", tmp_path / "prepared"
    env = finalization_probe(tmp_path / "probe")
    proc = start_job(run, prepared, eval_every=20, env=env)
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_job(proc, run)
    assert not OUR_TRACEBACK.search(err) and "terminate called" not in err, err[-3000:]
    saved = re.findall(r"saved checkpoint_last.pt at step (\d+)", err)
    assert len(saved) == 1, err[-3000:]
    step = int(saved[0])
    proc = torchrun(run, prepared, "--resume", f"train.max_steps={step + 10}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step {step} " in proc.stderr and (run / "results.json").is_file()
    assert not list((tmp_path / "probe").glob("finalized.*"))


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM to rank 1 alone, three times (signals reach the ranks at different moments: a scheduler signals
    each process, torchrun one after the other): the ranks stop together at the step they agreed on, rank 0
    saves it, the job ends. Before, a signal that reached rank 1 after that step's agreement (here, most often
    while rank 0 evaluates, every step) stopped rank 1 alone and rank 0 waited in its next all-reduce for good
    (this test hung each of the 6 times it ran against that code), and torchrun's SIGTERM once timed out in CI
    the same way, with no checkpoint saved."""
    for i in range(3):
        run = tmp_path / f"run{i}"
        proc = start_job(run, tmp_path / "prepared", eval_every=1)
        time.sleep(0.5)
        err = signal_rank_1(proc, run, signal.SIGTERM, timeout=60)
        assert proc.returncode != 0 and not OUR_TRACEBACK.search(err), err[-3000:]
        saved = re.findall(r"SIGTERM received: saved checkpoint_last.pt at step (\d+)", err)
        assert len(saved) == 1, err[-3000:]
