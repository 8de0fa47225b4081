"""The installable package carries everything the JIT needs (an installed wheel builds modules)."""
import subprocess
import sys
import zipfile

from conftest import REPO


def test_wheel_ships_the_hip_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True)
    (wheel,) = tmp_path.glob("hipkern-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(REPO / "csrc_hip").as_posix() for p in (REPO / "csrc_hip").rglob("*")
               if p.suffix in (".h", ".hip")}
    assert sources and {f"hipkern/_csrc/{s}" for s in sources} <= names
    from hipkern.jit.modules import all_specs

    for spec in all_specs():  # every module's sources are among them
        assert {f"hipkern/_csrc/{s}" for s in spec.sources} <= names


def test_installed_wheel_finds_the_shipped_tuning_results(tmp_path):
    """A wheel installed into a fresh venv (torch from the system site) reads its own copy of the
    tuning results, not the checkout's: a paged-attention shape of the H100 list resolves exactly."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(REPO)], check=True)
    (wheel,) = (tmp_path / "dist").glob("hipkern-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hipkern/_tuning/results/sm_90/paged_attention.csv" in names
    assert not [n for n in names if n.endswith(".candidates.csv")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)
    probe = (
        "import hipkern, hipkern.ops.paged_attention\n"
        "from hipkern import tuning_db\n"
        "d = tuning_db.shipped_results_dir()\n"
        "assert 'site-packages' in str(d), d\n"
        "c = tuning_db.lookup('paged_attention', 'sm_90', 132, dtype='bfloat16', head_size=128, block_size=16,\n"
        "                     num_q_heads=32, num_kv_heads=8, kv_layout='NHD', batch=64, context=4096)\n"
        "assert c is not None and c.source == 'exact', c\n"
        "print(hipkern.__file__, c.variant)\n")
    out = subprocess.run([str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "site-packages" in out.stdout
