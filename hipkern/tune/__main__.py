"""Command line of the tuner (see hipkern/tune/__init__.py and tuning/README.md)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..jit import JitError
from ..jit.platform import check_arch
from . import core, runner
from .report import report


def parse_gpus(text):
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"--gpus must be comma-separated GPU indices such as 0,1; got {text!r}")
    gpus = [int(p) for p in parts]
    if len(set(gpus)) != len(gpus):  # two workers timing on one GPU at once would write contended times
        raise ValueError(f"--gpus names a GPU twice ({text!r}): each GPU takes one timing worker")
    return gpus


def parse_where(items) -> dict:
    where = {}
    for item in items or ():
        k, eq, v = item.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise ValueError(f"--where must be key=value, e.g. dtype=bfloat16; got {item!r}")
        if k.strip() in where:  # (the last one used to win silently)
            raise ValueError(f"--where names {k.strip()} twice ({where[k.strip()]!r} and {v.strip()!r}): one "
                             "value a key; run once per value")
        where[k.strip()] = v.strip()
    return where


def _tune_parser():
    p = argparse.ArgumentParser(prog="python -m hipkern.tune", description="Tune an op's variants per shape; "
                                "'python -m hipkern.tune report OP' prints the result.")
    p.add_argument("op", help=f"an op with an adapter ({', '.join(sorted(core.ADAPTERS))}) or module:attribute")
    p.add_argument("--shapes", help="shape list CSV (default tuning/shapes/<op>.csv; an untuned log works too)")
    p.add_argument("--shape", action="append", help="a shape as key=value,...; repeatable (then no default list)")
    p.add_argument("--where", action="append", help="only shapes with key=value; repeatable")
    p.add_argument("--out", help="database CSV to merge into (default tuning/results/<arch>/<op>.csv)")
    p.add_argument("--gpus", help="comma-separated GPU indices: one worker process each")
    p.add_argument("--skip-done", action="store_true", help="skip candidates already measured for a shape")
    p.add_argument("--time-limit", type=float, help="seconds after which no new shape starts")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate only")
    p.add_argument("--arch", help="with --dry-run: plan for this arch instead of the GPU's")
    p.add_argument("--cu-count", type=int, help="with --dry-run: plan for this many CUs/SMs")
    p.add_argument("--device-name", help="with --dry-run --arch: the GPU's name (its rows count for --skip-done; "
                   "default none: only rows without a device)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _worker_parser():
    p = argparse.ArgumentParser(prog="python -m hipkern.tune _worker")
    p.add_argument("op")
    p.add_argument("--jobs", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--device", type=int, required=True)
    p.add_argument("--deadline-s", type=float)
    return p


def _report_parser():
    p = argparse.ArgumentParser(prog="python -m hipkern.tune report")
    p.add_argument("op")
    p.add_argument("--out", help="database CSV (default tuning/results/<arch>/<op>.csv)")
    p.add_argument("--arch", help="arch of the default file (default: the GPU's)")
    return p


def check_writable(out: Path) -> None:
    """A ValueError unless the database file `out` and its candidates file can be written: not a directory, in a
    directory that exists or can be made, where a file can be created."""
    import tempfile

    for path in (out, core.candidates_path(out)):
        if path.is_dir():
            raise ValueError(f"--out {out}: {path} is a directory; name the database CSV file (e.g. "
                             f"{path / 'fused_moe.csv'})")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=out.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--out {out}: its directory cannot be written ({e})") from None


def _default_out(op: str, arch: str, read_only: bool = False) -> Path:
    """The database file a run writes (the checkout's), or reads only (report, dry runs: also a wheel's)."""
    root = core.shipped_tuning_dir() if read_only else core.checkout_dir()
    return root / "results" / arch / f"{op}.csv"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        a = _worker_parser().parse_args(argv[1:])
        return runner.worker_main(a.op, a.jobs, a.log, a.device, a.deadline_s)
    if argv[:1] == ["report"]:
        a = _report_parser().parse_args(argv[1:])
        adapter = core.load_adapter(a.op)
        if a.arch is not None:
            a.arch = check_arch(a.arch)
        if a.out is None and a.arch is None and not _has_gpu():
            raise ValueError("report: no GPU visible: pass --out or --arch")
        out = Path(a.out) if a.out else _default_out(adapter.op, a.arch or adapter.device_info(0)["arch"],
                                                     read_only=True)
        print(report(adapter, out))
        return 0
    a = _tune_parser().parse_args(argv)
    gpus = parse_gpus(a.gpus)
    if a.time_limit is not None and not a.time_limit > 0:
        raise ValueError(f"--time-limit must be a positive number of seconds, got {a.time_limit}")
    if (a.arch is not None or a.cu_count is not None or a.device_name is not None) and not a.dry_run:
        raise ValueError("--arch/--cu-count/--device-name only apply to --dry-run (a run asks its GPU)")
    if (a.arch is None) != (a.cu_count is None) or (a.device_name is not None and a.arch is None):
        raise ValueError("--dry-run plans for another GPU with both --arch and --cu-count (and --device-name, "
                         "optionally, with them)")
    if a.cu_count is not None and a.cu_count < 1:
        raise ValueError(f"--cu-count must be a positive number of CUs/SMs, got {a.cu_count}")
    if a.arch is not None:
        a.arch = check_arch(a.arch)  # its canonical name (sm_90a is sm_90), or a JitError naming it
    if a.dry_run and not _has_gpu() and not (a.arch and a.cu_count):
        raise ValueError("--dry-run without a GPU needs --arch and --cu-count")
    if gpus and _has_gpu():
        import torch

        bad = [g for g in gpus if g >= torch.cuda.device_count()]
        if bad:
            raise ValueError(f"--gpus: {bad} not among the {torch.cuda.device_count()} GPUs visible")
    adapter = core.load_adapter(a.op)
    shapes = core.read_shapes(adapter, a.shapes, a.shape or (), parse_where(a.where))
    info = ({**adapter.info_for(a.arch, a.cu_count), "device": (a.device_name or "").strip()} if a.arch
            else runner.device_info(adapter, gpus))
    out = Path(a.out) if a.out else _default_out(adapter.op, info["arch"], read_only=a.dry_run)
    if not a.dry_run:
        check_writable(out)  # before any GPU time is spent, not at the first save
    elif not _has_gpu():
        print("hipkern.tune: --dry-run without a GPU plans with one resident block an SM for every kernel: its "
              "pruning and counts are not what a GPU of that kind would plan", flush=True)
    saved = signal.signal(signal.SIGTERM, _interrupt)  # a timeout's SIGTERM saves finished rows like Ctrl-C
    try:
        summary = runner.tune(adapter, shapes, out, spec=a.op, gpus=gpus, skip_done=a.skip_done,
                              time_limit=a.time_limit, progress=not a.no_progress, dry_run=a.dry_run, info=info)
    finally:
        signal.signal(signal.SIGTERM, saved)
    # 1 when a shape could not be tuned; a crash whose shapes the retry finished was reported above
    return 1 if summary.failed or (summary.left and not summary.stopped) else 0


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, JitError) as e:
        print(f"python -m hipkern.tune: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
