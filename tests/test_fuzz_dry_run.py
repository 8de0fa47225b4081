"""tests/fuzz.py's drawers on the CPU: every case it draws for each of the five ops passes that op's argument
checks (--dry-run), so that a GPU sweep spends its time on cases, and a change to an op's validation that refuses
cases the fuzz deems valid (or a drawer that breaks) fails here, without a GPU."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fuzz_dry_run_draws_only_accepted_cases():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fuzz.py"), "--dry-run", "30", "--op", "all",
                        "--seed", "11"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = dict(re.findall(r"^== (\w+): 30 cases; argument checks: (\{.*?\});", r.stdout, re.M))
    assert sorted(summary) == sorted(["paged_attention", "fused_moe", "topk_softmax", "grouped_topk", "moe_sorting"])
    for op, verdicts in summary.items():
        assert re.fullmatch(r"\{'ok': \d+\}", verdicts), f"{op}: {verdicts}"
