"""`mlxmtp bench` on the demo model with tiny settings: the JSON report's structure."""

import json

from click.testing import CliRunner

from mlxmtp.cli import main


def test_bench_json_on_the_demo_model():
    res = CliRunner().invoke(main, ["bench", "--json", "-p", "8,24", "-g", "6", "--depths", "1", "-n", "1"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["model"] == "mlxmtp-demo" and report["mtp_active"] is True
    assert report["generation_tokens"] == 6 and report["num_trials"] == 1
    assert [r["prompt_tokens"] for r in report["results"]] == [8, 24]
    for result in report["results"]:
        rows = {s["setting"]: s for s in result["settings"]}
        assert list(rows) == ["mlx-lm", "MTP off", "adaptive", "k=1"]
        for s in rows.values():
            assert s["generated_tokens"] == 6  # EOS ignored: every run makes exactly -g tokens
            assert s["ttft_s"] > 0 and s["prompt_tps"] > 0 and s["generation_tps"] > 0 and s["peak_mib"] > 0
            assert s["vs_mlx_lm"] > 0
        assert rows["mlx-lm"]["vs_mlx_lm"] == 1.0
        assert "acceptance_by_position" not in rows["MTP off"]
        # Pinned at 1 (a cycle may run plainly where no draft fits, as at the end of the budget).
        assert len(rows["k=1"]["acceptance_by_position"]) == 1 and rows["k=1"]["depths"].get("1", 0) >= 1
        assert set(rows["k=1"]["depths"]) <= {"0", "1"}
        assert rows["adaptive"]["tokens_per_forward"] >= 1.0


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
