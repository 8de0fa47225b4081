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
