"""``smp launch`` (:mod:`smp.cli.commands.launch`, :mod:`smp.cli.worker`): the torchrun command line, a real run on two
ranks, and Ctrl-C (slow: torchrun starts real processes)."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.helpers import REPO, ok, one_line_error, smp, smp_env


def test_launch_builds_torchrun_arguments(tmp_path: Path, capsys) -> None:
    from smp.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = ok(smp("launch", "-n", "4", "--dry-run", str(script), "--lr", "0.1"))
    assert out.split() == ["torchrun", "--nproc-per-node", "4", "--standalone", str(script), "--lr", "0.1"]

    def dry(*argv: str) -> list[str]:
        assert main(["launch", *argv]) == 0
        return capsys.readouterr().out.split()

    assert dry("-n", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29500", "--dry-run",
               str(script)) == ["torchrun", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
                                "--rdzv-endpoint", "head:29500", str(script)]
    out = " ".join(dry("-n", "2", "--master-addr", "10.0.0.1", "--master-port", "1234", "--nnodes", "2",
                       "--dry-run", str(script)))
    assert "--standalone" not in out and "--master-addr 10.0.0.1" in out and "--master-port 1234" in out


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
    one_line_error(smp("launch", "-n", "2", str(bad)), "failed on local rank(s) 1")


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
                   "failed on local rank(s) 0")
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
