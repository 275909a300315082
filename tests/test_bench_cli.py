"""`mlxmtp bench` on the demo model with tiny settings: the JSON report's structure."""

import json

import pytest
from click.testing import CliRunner

from mlxmtp.commands.main import main


@pytest.mark.slow
def test_bench_json_on_the_demo_model():
    res = CliRunner().invoke(main, ["bench", "--json", "-p", "8,24", "-g", "6", "--depths", "1", "-n", "1"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["model"] == "mlxmtp-demo" and report["mtp_active"] is True
    assert report["generation_tokens"] == 6 and report["num_trials"] == report["rounds"] == 1
    assert report["spread_limit"] == 1.15 and report["warnings"] == []  # one round: no range to judge
    assert [r["prompt_tokens"] for r in report["results"]] == [8, 24]
    for result in report["results"]:
        rows = {s["setting"]: s for s in result["settings"]}
        assert list(rows) == ["mlx-lm", "MTP off", "adaptive", "k=1"]
        for s in rows.values():
            assert s["generated_tokens"] == 6  # EOS ignored: every run makes exactly -g tokens
            assert s["ttft_s"] > 0 and s["prompt_tps"] > 0 and s["generation_tps"] > 0 and s["peak_mib"] > 0
            assert s["vs_mlx_lm"] > 0
        assert rows["mlx-lm"]["vs_mlx_lm"] == 1.0 and rows["mlx-lm"]["vs_mlx_lm_range"] == [1.0, 1.0]
        for s in rows.values():  # one round: each range is that round's value
            assert s["vs_mlx_lm_range"] == [s["vs_mlx_lm"]] * 2 and s["spread"] == 1.0
            assert s["generation_tps_range"] == [s["generation_tps"]] * 2
        assert "acceptance_by_position" not in rows["MTP off"]
        # Pinned at 1 (a cycle may run plainly where no draft fits, as at the end of the budget).
        assert len(rows["k=1"]["acceptance_by_position"]) == 1 and rows["k=1"]["depths"].get("1", 0) >= 1
        assert set(rows["k=1"]["depths"]) <= {"0", "1"}
        assert rows["adaptive"]["tokens_per_forward"] >= 1.0


@pytest.mark.slow
def test_bench_text_table_and_bad_options():
    res = CliRunner().invoke(main, ["bench", "-p", "8", "-g", "4", "--depths", "", "--no-mlx-lm"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert "prompt: 8 tokens" in lines and any(ln.startswith("adaptive (depths") for ln in lines)
    assert not any(ln.startswith("mlx-lm") for ln in lines)
    res = CliRunner().invoke(main, ["bench", "-p", "8,x"])
    assert res.exit_code == 2 and "--prompt-tokens" in res.output
    res = CliRunner().invoke(main, ["bench", "--depths", "9"])
    assert res.exit_code == 2 and "--depths" in res.output


def test_bench_runs_interleaved_rounds_prints_each_run_and_warns_when_ratios_spread(monkeypatch):
    """Three rounds by default, a line per run on stderr as it ends, the range of each ratio,
    and a warning when a ratio's range is too wide to trust (a busy machine)."""
    from mlxmtp.engine import benchmark

    speeds = {None: [100.0, 100.0, 100.0], 0: [99.0, 44.0, 98.0], "adaptive": [140.0, 141.0, 139.0]}
    order = []

    def one(model, tok, ids, gen, temp, setting, suffix=False):  # the timings a shared machine gives
        order.append(setting)
        runs = [s for s in order if s == setting]
        tps = speeds[setting][len(runs) - 1 - 1] if len(runs) > 1 else 1.0  # the first run is the warm-up
        out = {"ttft_s": 0.1, "prompt_tps": 80.0, "generation_tps": tps, "generated_tokens": gen, "peak_mib": 9.0}
        if setting not in (None, 0):
            out.update(acceptance_by_position=[0.9], tokens_per_forward=1.9, depths={1: 3})
        return out

    monkeypatch.setattr(benchmark, "one", one)
    res = CliRunner().invoke(main, ["bench", "-p", "8", "-g", "4", "--depths", "", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["rounds"] == report["num_trials"] == 3
    # Interleaved: every setting once per round, the order reversed on odd rounds (after the warm-ups).
    assert order[3:] == [None, 0, "adaptive", "adaptive", 0, None, None, 0, "adaptive"]
    rows = {s["setting"]: s for s in report["results"][0]["settings"]}
    assert rows["MTP off"]["vs_mlx_lm"] == 0.98 and rows["MTP off"]["vs_mlx_lm_range"] == [0.44, 0.99]
    assert rows["adaptive"]["vs_mlx_lm_range"] == [1.39, 1.41] and rows["adaptive"]["spread"] < 1.15
    assert rows["mlx-lm"]["generation_tps_range"] == [100.0, 100.0]
    assert report["warnings"] == ["prompt 8, MTP off: its ratio to mlx-lm ranged 0.44-0.99 over 3 rounds "
                                  "(max / min 2.25 > 1.15)"]
    progress = [ln for ln in res.stderr.splitlines() if ln.startswith("prompt 8  round")]
    assert len(progress) == 9 and progress[0].split() == ["prompt", "8", "round", "1/3", "mlx-lm", "100.0",
                                                           "tok/s", "TTFT", "0.100", "s"]
    assert "the machine is busy or noisy; rerun with more --rounds" in res.stderr
    order.clear()
    res = CliRunner().invoke(main, ["bench", "-p", "8", "-g", "4", "--depths", ""])
    assert res.exit_code == 0, res.output
    assert "0.98x (0.44-0.99)" in res.stdout and "rounds: 3" in res.stdout
    assert "the machine is busy or noisy; rerun with more --rounds" in res.stdout
