"""The installable package carries everything the JIT needs: an installed wheel builds modules and reads
its own tuning results. The wheel is built once, from a copy of the checkout without any earlier build
output (setuptools reuses a build/ directory, which would ship files since deleted)."""
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO, toolchain_or_skip

SOURCE_SUFFIXES = (".h", ".hip", ".hpp", ".cuh", ".inc")  # the sources and every header the JIT's key hashes


def _installed_env(**extra) -> dict:
    """The environment for the installed wheel's interpreter: without PYTHONPATH, which (as .ci/gpu sets it
    to the checkout) would import the checkout instead of the wheel."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "hipkern"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                            "scratch", ".pytest_cache", "gpu_results", "bench_results"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True)
    (whl,) = out.glob("hipkern-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory):
    """A fresh venv (torch from the system site) with the wheel installed."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, env=_installed_env())
    return py


def test_wheel_ships_exactly_the_hip_sources(wheel):
    from hipkern.jit import builder
    from hipkern.jit.modules import all_specs

    assert set(builder.HEADER_SUFFIXES) <= set(SOURCE_SUFFIXES)  # a header kind the key hashes is shipped too
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"hipkern/_csrc/{p.relative_to(REPO / 'csrc_hip').as_posix()}" for p in (REPO / "csrc_hip").rglob("*")
               if p.suffix in SOURCE_SUFFIXES}
    shipped = {n for n in names if n.startswith("hipkern/_csrc/") and n.endswith(SOURCE_SUFFIXES)}
    assert sources and shipped == sources, (sorted(sources - shipped), sorted(shipped - sources))
    for spec in all_specs():  # every module's sources are among them
        assert {f"hipkern/_csrc/{s}" for s in spec.sources} <= names


def test_installed_wheel_finds_the_shipped_tuning_results(wheel, venv_python, tmp_path):
    """The installed package reads its own copy of the tuning results, not the checkout's: a paged-attention
    shape of the H100 list resolves exactly."""
    names = zipfile.ZipFile(wheel).namelist()
    assert "hipkern/_tuning/results/sm_90/paged_attention.csv" in names
    assert not [n for n in names if n.endswith(".candidates.csv")]
    probe = (
        "import hipkern, hipkern.ops.paged_attention\n"
        "from hipkern import tuning_db\n"
        "d = tuning_db.shipped_results_dir()\n"
        "assert 'site-packages' in str(d), d\n"
        "c = tuning_db.lookup('paged_attention', 'sm_90', 132, device_name='NVIDIA H100 80GB HBM3', dtype='bfloat16',\n"
        "                     head_size=128, block_size=16, num_q_heads=32, num_kv_heads=8, kv_layout='NHD',\n"
        "                     batch=64, context=4096)\n"
        "assert c is not None and c.source == 'exact', c\n"
        "print(hipkern.__file__, c.variant)\n")
    out = subprocess.run([str(venv_python), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env=_installed_env())
    assert out.returncode == 0, out.stderr
    assert "site-packages" in out.stdout


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_installed_wheel_builds_a_module(venv_python, tmp_path, arch):
    """From its own hipkern/_csrc (no checkout in sight), for both targets."""
    toolchain_or_skip(arch, tmp_path)
    probe = (
        "from hipkern import jit\n"
        "from hipkern.jit import _paths\n"
        "assert 'site-packages' in str(_paths.csrc_root()), _paths.csrc_root()\n"
        f"r = jit.build(jit.spec('topk_softmax', dtype='float16'), '{arch}')\n"
        f"m = jit.load(jit.spec('topk_softmax', dtype='float16'), '{arch}')\n"
        "print('built', r.path)\n")
    out = subprocess.run([str(venv_python), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env=_installed_env(HIPKERN_JIT_DIR=str(tmp_path / "jit")))
    assert out.returncode == 0, out.stderr
    assert "built" in out.stdout


def test_installed_wheel_reports_and_plans_from_its_shipped_tuning(venv_python, tmp_path):
    """`python -m hipkern.tune report` and `--dry-run` read the wheel's shipped shapes and rows (no checkout in
    sight; they used to ask for a checkout's tuning/)."""
    def tune(*args):
        return subprocess.run([str(venv_python), "-m", "hipkern.tune", *args], cwd=tmp_path, capture_output=True,
                              text=True, env=_installed_env())

    out = tune("report", "fused_moe", "--arch", "sm_90")
    assert out.returncode == 0, out.stderr
    assert "NVIDIA H100 80GB HBM3" in out.stdout and "bfloat16 D7168 I256 E256 top8 T1 " in out.stdout
    out = tune("fused_moe", "--dry-run", "--arch", "sm_90", "--cu-count", "132")  # the shipped shapes list
    assert out.returncode == 0, out.stderr
    assert re.search(r"sm_90 \(132 CUs\): 65 shapes to tune", out.stdout + out.stderr), out.stdout + out.stderr
