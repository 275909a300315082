"""`mlxmtp launch`: mlx.launch whose launcher idles while its ranks work and fails when one
of them fails (mlxmtp/distributed/launch.py). The ranks here are shell commands; the 2-rank
runs of mlxmtp itself go through it too (tests/test_distributed.py)."""

import subprocess
import sys

from click.testing import CliRunner
from dist_helpers import BIN, free_ports

from mlxmtp.commands.main import main

# The CPU seconds a command and its children used, printed on its last line.
_CPU_OF = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
           "r = resource.getrusage(resource.RUSAGE_CHILDREN); print(); print(r.ru_utime + r.ru_stime); "
           "sys.exit(p.returncode)")


def _launch(rank_script: str, seconds_of_cpu=False) -> subprocess.CompletedProcess:
    """Two ranks of `sh -c rank_script` under `mlxmtp launch`, its stdin at end of file (as a
    supervisor starts it)."""
    cmd = [str(BIN / "mlxmtp"), "launch", "--backend", "ring", "-n", "2", "-p", str(free_ports(2)), "--",
           "/bin/sh", "-c", rank_script]
    if seconds_of_cpu:
        cmd = [sys.executable, "-c", _CPU_OF, *cmd]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def test_the_launcher_idles_while_its_ranks_work():
    """mlx.launch's relays poll the ranks' input, always ready, and its main loop its own input
    at end of file: the launcher used ~3.7 s of CPU beside two ranks that sleep 4 s. Here it
    uses what starting Python and MLX costs (about 0.4 s)."""
    res = _launch("sleep 3; echo rank $MLX_RANK done", seconds_of_cpu=True)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split("\n")[:2]) == ["rank 0 done", "rank 1 done"]
    assert float(res.stdout.split()[-1]) < 1.2, res.stdout


def test_a_failed_rank_fails_the_launch():
    """mlx.launch exits 0 whatever its ranks did; a supervisor restarting the group needs to
    see a failure."""
    assert _launch("exit 0").returncode == 0
    res = _launch('if [ "$MLX_RANK" = 1 ]; then echo rank 1 fails >&2; exit 3; fi; sleep 30')
    assert res.returncode == 1
    assert "rank 1 fails" in res.stderr


def test_help_names_mlx_launch_s_options():
    res = CliRunner().invoke(main, ["launch", "--help"])
    assert res.exit_code == 0
    assert "mlx.launch" in res.output and "--hostfile" in res.output
