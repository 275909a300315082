"""Running mlxmtp on 2 ranks on this machine, over loopback with MLX's ring backend:
through MLX's own launcher (`mlxmtp launch --backend ring -n 2`, mlx.launch mended), or rank by rank with the
environment the launcher gives each rank (the fault tests need each rank's own process)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

from server_helpers import BENCH, free_port

BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"


def mlx_launch(args: List[str], timeout: float = 600, ranks: int = 2) -> subprocess.CompletedProcess:
    """`mlxmtp launch --backend ring -n ranks -- args` (args[0]: a program on PATH or a path),
    run by bench/distributed.py's `launch`."""
    cmd = [str(BIN / "mlxmtp"), "launch", "--backend", "ring", "-n", str(ranks), "-p", str(free_ports(ranks)), "--", *args]
    return _bench_distributed().launch(cmd, timeout=timeout, env=_env())


def free_ports(n: int) -> int:
    """The first of `n` consecutive free loopback ports: the ring launcher gives rank r port
    p + r, and a free p alone let rank 1 meet a port another test held ("Couldn't bind socket")."""
    for _ in range(200):
        first, held = free_port(), []
        try:
            for port in range(first, first + n):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _bench_distributed():
    spec = importlib.util.spec_from_file_location("bench_distributed", BENCH / "distributed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def last_json(stdout: str):
    """The last line of `stdout` that is a JSON object (rank 0's result)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON result in the output:\n{stdout[-2000:]}")


def run_worker(*args: str, timeout: float = 900):
    """tests/distributed_worker.py on 2 ranks -> rank 0's JSON result."""
    res = mlx_launch([str(BIN / "python"), str(WORKER), *args], timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    try:
        return last_json(res.stdout)
    except AssertionError as missing:  # the ranks' own words say why
        raise AssertionError(f"{missing}\nstderr:\n{res.stderr[-4000:]}") from None


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def start_ranks(tmp_path: Path, rank_args: List[List[str]], **popen) -> List[subprocess.Popen]:
    """One process per rank, each with the environment mlx.launch gives it (MLX_RANK and a
    ring hostfile on loopback)."""
    hosts = [[f"127.0.0.1:{free_port()}"] for _ in rank_args]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(hosts))
    procs = []
    for rank, args in enumerate(rank_args):
        env = {**_env(), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "MLX_WORLD_SIZE": str(len(rank_args))}
        procs.append(subprocess.Popen(args, env=env, **popen))
    return procs
