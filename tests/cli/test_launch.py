"""``smp launch`` (:mod:`smp.cli.commands.launch`, :mod:`smp.cli.worker`): the torchrun command line, a real run on two
ranks, and Ctrl-C (slow: torchrun starts real processes)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.helpers import REPO, ok, one_line_error, smp_env
from tests.cli.helpers import smp_process as smp  # torchrun, consoles, signals: the real process


def test_dry_run_prints_the_command_it_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    """``--dry-run`` prints the environment it adds and torchrun's arguments as they run: the worker module, the
    per-rank logs; on one machine no ``--max-restarts`` (smp launch restarts the job itself, and says so)."""
    from smp.cli import main

    for name in ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "SMP_HEALTH_STOP_FILE", "SMP_LAUNCH_CONSOLE_RANK"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = ok(smp("launch", "-n", "4", "--dry-run", "--log-dir", str(tmp_path / "logs"), str(script), "--lr", "0.1"))
    words = out.split()
    log_dir = words[words.index("--log-dir") + 1]
    assert Path(log_dir).parent == tmp_path / "logs" and not Path(log_dir).exists()
    assert words == ["OMP_NUM_THREADS=1", "THP_MEM_ALLOC_ENABLE=1", f"SMP_HEALTH_STOP_FILE={log_dir}/health-stop",
                     "SMP_LAUNCH_CONSOLE_RANK=0", "torchrun", "--nproc-per-node", "4", "--standalone", "--log-dir",
                     log_dir, "--redirects", "1:2,2:2,3:2", "--module", "smp.cli.worker", str(script), "--lr", "0.1"]

    def dry(*argv: str) -> list[str]:
        assert main(["launch", *argv]) == 0
        lines = capsys.readouterr().out.splitlines()
        words = lines[0].split()
        return words[words.index("torchrun"):] + lines[1:]

    got = dry("-n", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29500", "--max-restarts", "2",
              "--dry-run", str(script))  # several machines: torchrun's agents restart every node together
    assert got[:11] == ["torchrun", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                        "head:29500", "--max-restarts", "2"] and got[-3:] == ["--module", "smp.cli.worker", str(script)]
    out = " ".join(dry("-n", "1", "--master-addr", "10.0.0.1", "--master-port", "1234", "--nnodes", "2",
                       "--dry-run", str(script)))
    assert "--standalone" not in out and "--master-addr 10.0.0.1" in out and "--master-port 1234" in out
    assert "--redirects" not in out  # one rank: its stderr is the console
    assert main(["launch", "-n", "2", "--max-restarts", "1", "--dry-run", str(script)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "# if it fails, smp launch runs it again, up to 1 more time(s) " \
                                                      "(--max-restarts)"  # --standalone: a new rendezvous anyway


_FAILS_ON_RANK_1 = """import os, sys, warnings
warnings.warn("a library warning")
print("rank", os.environ["RANK"], "up", flush=True)
if os.environ["RANK"] == "1":
    raise RuntimeError("no batch for rank 1: " + "x" * 2000)
import time
time.sleep(30)
"""


def test_a_failure_reads_in_one_screen(tmp_path: Path) -> None:
    """A raise on rank 1: exit status 1 (not 2, the command line's), a few lines naming the rank, the cause once and
    where the traceback and the logs are; the warning every rank gave shows once; no torchrun banner or log line."""
    script = tmp_path / "fails.py"
    script.write_text(_FAILS_ON_RANK_1)
    done = smp("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script), timeout=120)
    report = done.stdout + done.stderr
    assert done.returncode == 1, report
    assert len(report.splitlines()) < 15, report
    error = one_line_error(done, "failed on rank 1: RuntimeError: no batch for rank 1", "(fails.py, line 5)")
    assert "(cut; the whole message is in error.json)" in error and len(error) < 800, error
    assert report.count("UserWarning: a library warning") == 1 and "Traceback" not in report, report
    assert "OMP_NUM_THREADS" not in report and "exitcode" not in report, report
    log = Path(re.search(r"full log: (\S+)", done.stderr).group(1))  # rank 1's stderr went to its log only
    assert log.name == "stderr.log" and log.parent.name == "1" and str(tmp_path / "logs") in str(log)
    assert "Traceback" in log.read_text() and "a library warning" in log.read_text()
    error = json.loads((log.parent / "error.json").read_text())["message"]["extraInfo"]["py_callstack"]
    assert "no batch for rank 1" in error
    assert f"logs of every rank: {log.parent.parent}/<local rank>/" in done.stderr


def test_a_config_typo_reads_in_one_screen(tmp_path: Path) -> None:
    """A misspelt config key under ``smp launch``: the did-you-mean is on the console whole (it used to follow every
    valid key and be cut off), and the failed rank's full log is a file the report names (for the console rank, whose
    stderr was the console, the traceback the worker wrote)."""
    script = tmp_path / "typo.py"
    script.write_text('import smp\nsmp.init({"pipeline_parallel_degree": 2, "microbatchs": 2})\n')
    done = smp("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script), timeout=120)
    report = done.stdout + done.stderr
    assert len(report.splitlines()) <= 4 and "cut;" not in report, report
    error = one_line_error(done, "ConfigError: unknown smp config key(s) ['microbatchs'] ('microbatchs': did you "
                           "mean 'microbatches'?)", "(typo.py, line 2)")
    assert "pipeline_parallel_degree" not in error, error  # no list of every key
    log = Path(re.search(r"full log: (\S+)", done.stderr).group(1))  # both ranks fail; either may be first
    assert log.name == {"0": "traceback.log", "1": "stderr.log"}[log.parent.name], log
    assert "Traceback" in log.read_text() and "microbatchs" in log.read_text()


_DOES_NOT_TRACE = """import torch
import smp

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            h = h * 2
        return self.b(h)

smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
model = smp.DistributedModel(Net())

@smp.step
def step(model, x):
    loss = model(x).sum()
    model.backward(loss)
    return loss

step(model, torch.randn(4, 8))
"""


@pytest.mark.slow
def test_a_model_that_does_not_trace_reads_in_one_screen(tmp_path: Path) -> None:
    """Issue 26's case: it printed 493 lines (a torch.export traceback per rank), then 30 (torch's partial graph,
    twice, before the report). Now: a few lines naming the module and its source line, the fix on a line of its
    own, and the rank's full log, which holds the traceback and the graph torch printed."""
    script = tmp_path / "notrace.py"
    script.write_text(_DOES_NOT_TRACE)
    done = smp("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script), timeout=300)
    report = done.stdout + done.stderr
    assert done.returncode == 1 and len(report.splitlines()) <= 6, report
    assert "def forward" not in report and "Unable to find user code" not in report, report
    line = _DOES_NOT_TRACE.splitlines().index("step(model, torch.randn(4, 8))") + 1
    error = one_line_error(done, "TraceError: cannot trace Net", "in module Net (Net, notrace.py:11)",
                           f"(notrace.py, line {line})")
    assert "Fix:" not in error and "\n  fix: the model branches on tensor values (data-dependent control flow)" in \
        done.stderr, done.stderr
    assert report.count("cannot trace Net") == 1 and "Traceback" not in report, report
    log = Path(re.search(r"full log: (\S+)", done.stderr).group(1)).read_text()
    assert "Traceback" in log and "torch.export printed before it failed" in log and "def forward" in log, log


def test_torch_exports_printout_goes_with_the_trace_error(capfd) -> None:
    """What torch.export prints before it fails (its partial graph, twice, and a warning) is not printed: it is a
    note of the :class:`TraceError`, in the traceback (a rank's log under ``smp launch``), after the message."""
    import traceback

    import torch

    import partitioner
    from partitioner.capture.tracing import TraceError

    namespace: dict = {}
    exec(_DOES_NOT_TRACE.split("smp.init")[0].replace("import smp", ""), namespace)
    capfd.readouterr()
    with pytest.raises(TraceError) as err:
        partitioner.trace(namespace["Net"](), (torch.randn(2, 8),))
    assert capfd.readouterr().err == ""
    printed = "".join(traceback.format_exception(err.value))
    assert printed.index("Fix: the model branches") < printed.index("torch.export printed before it failed") \
        < printed.index("def forward"), printed


def test_the_report_names_the_first_failure_and_not_the_ranks_torchrun_stopped(tmp_path: Path) -> None:
    """:func:`smp.cli.launch_report.failure_report` on torchrun's failures: SIGTERM is torchrun stopping a rank,
    not a cause; the earliest error file wins; a rank with no error file is described by its exit and its stderr."""
    from types import SimpleNamespace as F

    from smp.cli.launch_report import failure_report

    attempt = tmp_path / "attempt_0"
    (attempt / "2").mkdir(parents=True)
    (attempt / "2" / "stderr.log").write_text("\n".join(f"line {i}" for i in range(9)) + "\n\n")
    error = {"message": {"message": "ValueError: bad\n  value", "extraInfo": {
        "py_callstack": 'File "/x/train.py", line 3, in f\nFile "/lib/torch.py", line 9', "timestamp": "5"}}}
    failures = {0: F(local_rank=0, exitcode=-signal.SIGTERM, timestamp=1, error_file="<N/A>", error_file_data={}),
                2: F(local_rank=2, exitcode=3, timestamp=6, error_file="<N/A>", error_file_data={}),
                3: F(local_rank=3, exitcode=1, timestamp=5, error_file="/nowhere/error.json", error_file_data=error)}
    head, lines = failure_report("/x/train.py", failures, str(attempt))
    assert head == "/x/train.py failed on rank 3; 2 ranks failed (2, 3), rank 3 first: ValueError: bad value " \
                   "(train.py, line 3)", head
    assert lines == [f"  logs of every rank: {attempt}/<local rank>/ (stderr.log, error.json; local rank 0 wrote "
                     "to this console)"]
    head, lines = failure_report("/x/train.py", {k: failures[k] for k in (0, 2)}, str(attempt))
    assert head == "/x/train.py failed on rank 2: exited with status 3", head
    assert lines[:5] == [f"  its stderr ended with: line {i}" for i in range(4, 9)], lines
    head, _ = failure_report("t.py", {5: F(local_rank=1, exitcode=-9, timestamp=1, error_file="<N/A>",
                                           error_file_data={})}, None)
    assert head == "t.py failed on rank 5 (local rank 1): killed by SIGKILL", head


@pytest.mark.slow
def test_launch_runs_the_script_on_n_ranks(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write("
                      "' '.join([os.environ['WORLD_SIZE'], os.environ['THP_MEM_ALLOC_ENABLE'], *sys.argv[2:]]))\n")
    ok(smp("launch", "-n", "2", str(script), str(tmp_path), "--flag", "x"))
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == "2 1 --flag x"
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = smp("launch", "-n", "2", str(bad))
    assert done.returncode == 1
    one_line_error(done, "failed on rank 1: exited with status 3")


def test_each_rank_runs_the_script_as_main_and_ends_quietly_on_ctrl_c(tmp_path: Path) -> None:
    """``python -m smp.cli.worker script args`` is ``python script args``, but Ctrl-C is exit 130, no traceback."""
    script = tmp_path / "job.py"
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    script.write_text("import sys\nfrom helper import VALUE\nprint(__name__, VALUE, sys.argv[1:])\n"
                      "if '--stop' in sys.argv: raise KeyboardInterrupt\n"
                      "if '--fail' in sys.argv: sys.exit(5)\n")

    def worker(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "smp.cli.worker", str(script), *args], capture_output=True,
                              text=True, env=smp_env(), cwd=REPO, timeout=60)

    done = worker("a", "--b")
    assert (done.returncode, done.stdout) == (0, "__main__ 7 ['a', '--b']\n")
    stopped = worker("--stop")
    assert stopped.returncode == 130 and stopped.stderr == ""
    assert worker("--fail").returncode == 5


def test_a_rank_records_its_exception_in_torchruns_error_file(tmp_path: Path) -> None:
    """The worker writes the exception to ``TORCHELASTIC_ERROR_FILE`` (torchrun's ``record``) and exits 1; the traceback
    goes to stderr except on the console's rank; after a health stop a (re)started rank does not run the script."""
    script = tmp_path / "job.py"
    script.write_text("raise ValueError('bad value 7')\n")

    def worker(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "smp.cli.worker", str(script)], capture_output=True, text=True,
                              env={**smp_env(), **env}, cwd=REPO, timeout=60)

    error_file = tmp_path / "error.json"
    console = worker(TORCHELASTIC_ERROR_FILE=str(error_file), LOCAL_RANK="0", SMP_LAUNCH_CONSOLE_RANK="0")
    assert (console.returncode, console.stderr) == (1, "")
    assert json.loads(error_file.read_text())["message"]["message"] == "ValueError: bad value 7"
    other = worker(LOCAL_RANK="1", SMP_LAUNCH_CONSOLE_RANK="0")
    assert other.returncode == 1 and "Traceback" in other.stderr and "bad value 7" in other.stderr
    stop = tmp_path / "stop"
    stop.write_text("ExplodingTensor at step 3\n")
    assert worker(SMP_HEALTH_STOP_FILE=str(stop)).returncode == 79


@pytest.mark.slow
def test_ctrl_c_says_interrupted_once(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint('rank', os.environ['RANK'], 'up', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "smp.cli", "launch", "-n", "2", str(script)], cwd=REPO,
                            env=smp_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        up = [proc.stdout.readline() for _ in range(2)]
        assert all("up" in line for line in up), up
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert err.count("interrupted") == 1 and "smp: interrupted" in err, err


# A tiny GPT-2 (tied embeddings) for the multi-node run: pp2 x dp2 over 4 ranks, a few steps.
_GPT2 = ["examples/train_gpt2.py", "--partitions", "2", "--steps", "3", "--layers", "2", "--hidden", "32",
         "--heads", "2", "--vocab", "64", "--seq", "16", "--batch", "8", "--microbatches", "2"]
_STEP = re.compile(r"^step\s+(\d+)/\d+\s+loss\s+(\S+)", re.M)


def _step_losses(stdout: str) -> list[str]:
    return [loss for _, loss in _STEP.findall(stdout)]


@pytest.mark.slow
def test_two_nodes_through_torchrun_rendezvous_train_as_one(tmp_path: Path) -> None:
    """Two ``smp launch --nnodes 2 --node-rank R --rdzv-endpoint localhost:PORT`` agents (2 ranks each, the
    grid pp2 x dp2 spans both "nodes") train to the losses of one 4-process node."""
    from smp.runtime.rank_env import free_port

    endpoint = f"localhost:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "smp.cli", "launch", "-n", "2", "--nnodes", "2", "--node-rank",
                               str(r), "--rdzv-endpoint", endpoint, *_GPT2, "--out", str(tmp_path / "nodes")],
                              cwd=REPO, env=smp_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outs):
        assert node.returncode == 0, f"exit {node.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    multi = _step_losses(outs[0][0])  # global rank 0 lives on node 0 and prints the losses
    assert len(multi) == 3 and _step_losses(outs[1][0]) == [], outs
    assert "2 pipeline stages x 2 data-parallel replica(s)" in outs[0][0]
    single = ok(smp("launch", "-n", "4", *_GPT2, "--out", str(tmp_path / "single"), timeout=240))
    assert _step_losses(single) == multi, (single, multi)
    # The trained weights too, bit for bit, and the plan: each pipeline rank's partial checkpoint.
    import torch

    for part in ("gpt2.model_0", "gpt2.model_1"):
        got, want = (torch.load(tmp_path / run / part, weights_only=False) for run in ("nodes", "single"))
        assert got.keys() == want.keys() and "_smp_plan" in want
        for name, value in want.items():
            same = torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value
            assert same, f"{part}: {name} differs after training on two nodes"


def test_a_job_a_health_rule_stopped_is_not_restarted(tmp_path: Path) -> None:
    """``--max-restarts`` restarts a failed job, but not one a training-health rule stopped (exit status 79)."""
    from smp.runtime.health_options import STOP_EXIT_STATUS, STOP_FILE_ENV

    script = tmp_path / "job.py"
    script.write_text("import os, sys\n"
                      "runs = os.path.join(sys.argv[1], 'runs')\n"
                      "open(runs, 'a').write('x')\n"
                      "if sys.argv[2] == 'stop':\n"
                      f"    open(os.environ[{STOP_FILE_ENV!r}], 'w').write('ExplodingTensor at step 3: loss')\n"
                      f"    sys.exit({STOP_EXIT_STATUS})\n"
                      "sys.exit(1)\n")
    from smp.cli.commands.launch import launch

    assert launch(["-n", "1", "--max-restarts", "2", str(script), str(tmp_path), "stop"]) == STOP_EXIT_STATUS
    assert (tmp_path / "runs").read_text() == "x"
    (tmp_path / "runs").unlink()
    one_line_error(smp("launch", "-n", "1", "--max-restarts", "1", str(script), str(tmp_path), "fail"),
                   "failed on rank 0: exited with status 1")
    assert (tmp_path / "runs").read_text() == "xx"  # restarted once


def test_a_stale_stop_file_or_a_bad_restart_count_does_not_decide_a_launch(tmp_path, monkeypatch) -> None:
    """An earlier job's health-stop reason is removed before each attempt, and --max-restarts must be a count."""
    from smp.cli import main
    from smp.runtime.health_options import STOP_FILE_ENV

    stale = tmp_path / "stop"
    stale.write_text("ExplodingTensor at step 3: an earlier job's reason\n")
    monkeypatch.setenv(STOP_FILE_ENV, str(stale))
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    assert main(["launch", "-n", "1", "--max-restarts", "1", str(script)]) == 0
    assert not stale.exists()
    assert main(["launch", "-n", "1", "--max-restarts", "two", str(script)]) == 2
