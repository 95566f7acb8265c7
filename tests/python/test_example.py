"""examples/train_with_torch.py trains: spawned with --nproc 2 and under torchrun-style
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), its loss falls."""

import os
import re
import socket
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_with_torch.py")


def losses(output):
    m = re.search(r"loss ([0-9.]+) -> ([0-9.]+) over (\d+) steps", output)
    assert m, output
    return float(m.group(1)), float(m.group(2))


def test_example_trains_with_nproc():
    run = subprocess.run([sys.executable, EXAMPLE, "--nproc", "2", "--steps", "40",
                          "--algorithm", "all_gather", "--load-balance", "--schedule", "async"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    first, last = losses(run.stdout)
    assert last < 0.8 * first, run.stdout


def test_example_runs_under_launcher_variables():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, EXAMPLE, "--steps", "5"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    losses(outs[0][0])
