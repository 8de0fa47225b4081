"""Running a tuning: the plan and its estimate, in this process or one worker process per GPU, the
progress bar, crash retries, checkpoints, and the time each shape took."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import core
from .core import Candidate, DeviceLost, candidate_of, candidates_path, make_row, shape_key

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # tqdm is optional: Progress then prints a line every PLAIN_EVERY_S seconds
    _tqdm = None
PLAIN_EVERY_S = 10.0


@dataclasses.dataclass
class Summary:
    shapes: int = 0  # asked for
    skipped: int = 0  # every candidate measured already (--skip-done)
    planned: int = 0  # candidates to time
    estimate_s: float = 0.0
    done: dict = dataclasses.field(default_factory=dict)  # shape index -> seconds it took
    failed: dict = dataclasses.field(default_factory=dict)  # shape index -> why it has no rows
    crashes: list = dataclasses.field(default_factory=list)
    per_gpu: dict = dataclasses.field(default_factory=dict)  # device -> shapes done
    rows: int = 0
    rejected: int = 0
    stopped: bool = False  # the time limit passed
    left: int = 0  # shapes neither tuned nor failed when the run ended
    db_rows: int = 0
    complete: set = dataclasses.field(default_factory=set)  # keys of shapes measured before (--skip-done)
    retired: dict = dataclasses.field(default_factory=dict)  # key -> candidates pruned (same launch, dominated)


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.n, self.total, self.t0, self.last = 0, total, core._now(), core._now()
        self.bar = _tqdm(total=total, unit="cand", dynamic_ncols=True) if enabled and _tqdm else None
        self.plain = enabled and _tqdm is None

    def update(self, label: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.plain and (core._now() - self.last >= PLAIN_EVERY_S or self.n == self.total):
            self.last = core._now()
            print(f"[tune] {self.n}/{self.total} candidates, {self.last - self.t0:.0f} s ({label})", flush=True)

    def write(self, text: str) -> None:
        (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Run:
    """A run's events (from this process or from workers' logs): rows, finished shapes, progress."""

    def __init__(self, adapter, out, jobs, info, run_stamp, summary, progress: bool):
        self.adapter, self.schema, self.out, self.info, self.stamp = adapter, adapter.schema, out, info, run_stamp
        self.jobs, self.summary = {j["i"]: j for j in jobs}, summary
        self.rows, self.measured, self.open, self.current = [], {i: set() for i in self.jobs}, {}, {}
        self.chosen_from = {i for i, j in self.jobs.items() if j.get("chosen")}  # shapes with a usable row
        self.saved = 0  # self.rows[:saved] are in the files
        self.progress = Progress(sum(len(j["cands"]) for j in jobs), progress)
        self.saved_at, self.t0 = core._now(), core._now()

    def handle(self, ev: dict, src=None) -> None:
        kind, i = ev["ev"], ev.get("i")
        if kind == "shape":
            self.current[src] = i
        elif kind == "begin":
            self.open[i] = ev["cand"]
        elif kind == "row":
            self.add_row(i, ev["row"])
        elif kind in ("done", "failed"):
            self.current.pop(src, None)
            if kind == "done":
                self.finished(i, ev["s"])
                gpu = getattr(src, "gpu", src)
                self.summary.per_gpu[gpu] = self.summary.per_gpu.get(gpu, 0) + 1
                self.checkpoint()
            else:
                self.summary.failed[i] = ev["note"]
                self.progress.write(f"hipkern.tune: {self.adapter.describe(self.jobs[i]['shape'])}: {ev['note']}")
        elif kind == "stop":
            self.summary.stopped = True

    def finished(self, i: int, seconds: float) -> None:
        """Shape i has every candidate measured: tuned, or failed where none may be chosen (every one rejected:
        its database row stays, and the exit status says so)."""
        if i in self.chosen_from:
            self.summary.done[i] = seconds
            return
        why = "every candidate was rejected (see above); its database row, if any, is kept"
        self.summary.failed[i] = why
        self.progress.write(f"hipkern.tune: {self.adapter.describe(self.jobs[i]['shape'])}: {why}")

    def add_row(self, i: int, row: dict) -> None:
        if core.usable(self.schema, row):
            self.chosen_from.add(i)
        self.rows.append(row)
        self.open.pop(i, None)
        name = candidate_of(self.schema, row).name
        self.measured[i].add(name)
        self.summary.rows += 1
        label = self.adapter.describe(self.jobs[i]["shape"])
        if row["status"] != "ok":
            self.summary.rejected += 1
            self.progress.write(f"rejected {name} on {label}: {row['note']}")
        self.progress.update(label)

    def complete_keys(self) -> set:
        head = core.gpu_kind(self.info)
        return self.summary.complete | {head + shape_key(self.schema, self.jobs[i]["shape"]) for i in self.summary.done}

    def save(self) -> None:
        # Only the rows not saved yet: re-sending earlier ones would put them back over a newer measurement that
        # another tuner saved meanwhile.
        n = len(self.rows)
        self.summary.db_rows = core.save(self.schema, self.out, self.rows[self.saved:n], self.complete_keys(),
                                         default_of(self.adapter), self.summary.retired)
        self.saved, self.saved_at = n, core._now()

    def checkpoint(self) -> None:
        if core._now() - self.saved_at >= core.CHECKPOINT_S:
            self.save()

    def after_crash(self, worker) -> list:
        """Record the candidate a crashed worker was running as rejected; the jobs left to retry."""
        rc, retry = worker.proc.returncode, []
        unfinished = [j for j in worker.jobs if j["i"] not in self.summary.done and j["i"] not in self.summary.failed]
        msg = (f"worker on GPU {worker.gpu} crashed (exit code {rc}) with {len(unfinished)} of {len(worker.jobs)} "
               f"shapes unfinished; its last output:\n{worker.tail()}")
        self.summary.crashes.append(msg)
        self.progress.write("hipkern.tune: " + msg)
        for j in unfinished:
            culprit, left = self.open.pop(j["i"], None), []
            for variant, params in j["cands"]:
                cand = Candidate(variant, tuple(tuple(p) for p in params))
                if cand.name == culprit:
                    self.add_row(j["i"], make_row(self.schema, self.info, j["shape"], cand, "rejected", None, 0, None,
                                                  f"the worker crashed (exit code {rc}) running it", self.stamp))
                elif cand.name not in self.measured[j["i"]]:
                    left.append([variant, params])
            if left:
                retry.append({**j, "cands": left, "suspect": self.current.get(worker) == j["i"]})
            else:
                self.finished(j["i"], 0.0)
        return retry

    def finish(self, interrupted: bool) -> None:
        self.progress.close()
        self.save()
        s, secs = self.summary, list(self.summary.done.values())
        wall = core._now() - self.t0
        print(f"hipkern.tune: {len(secs)} shapes tuned, {s.rows} candidates measured ({s.rejected} rejected) in "
              f"{wall:.0f} s (estimated {s.estimate_s:.0f} s of GPU time); {self.out} has {s.db_rows} rows", flush=True)
        if secs:
            q = statistics.quantiles(secs, n=10, method="inclusive")[-1] if len(secs) > 1 else secs[0]
            print(f"  seconds per shape: mean {statistics.mean(secs):.2f}, median {statistics.median(secs):.2f}, "
                  f"p90 {q:.2f}, max {max(secs):.2f}; per GPU: {s.per_gpu}")
            for i in sorted(s.done, key=s.done.get, reverse=True)[:5]:
                print(f"  {s.done[i]:7.2f} s  {self.adapter.describe(self.jobs[i]['shape'])}")
        left = [i for i in self.jobs if i not in s.done and i not in s.failed]
        s.left = len(left)
        for i, why in sorted(s.failed.items()):
            print(f"  not tuned: {self.adapter.describe(self.jobs[i]['shape'])}: {why}")
        if left or interrupted:
            why = "interrupted" if interrupted else "time limit reached" if s.stopped else "stopped"
            print(f"hipkern.tune: {why} with {len(left)} shapes left; finished rows are kept: rerun with --skip-done "
                  f"to go on", flush=True)


def plan(adapter, shapes, out, info, skip_done: bool) -> tuple:
    """(jobs, summary): each shape's candidates to time, its estimated seconds, and the totals printed before
    starting. With --skip-done, a shape's candidates measured already (usable, or rejected for a wrong result) are
    not timed again, unless the shape has a candidate never measured on this GPU: then all of them are, so that
    its choice compares times of one run (a new candidate's time against the incumbents' of an earlier run
    compared two machines' or two runs' speeds: 2-5 % apart on one H200 kind, NOTES.md 2026-11-29 (19))."""
    schema, summary, done = adapter.schema, Summary(shapes=len(shapes)), {}
    measured = core._load(schema, candidates_path(out))
    db = core._load(schema, out)  # a malformed file fails here, before any GPU time is spent
    kind = core.gpu_kind(info)
    unnamed = sum(core.gpu_kind(r) == kind[:2] + ("",) for r in measured + db)
    if unnamed and kind[2]:
        print(f"hipkern.tune: {unnamed} rows of {out} and its candidates for {kind[0]} with {kind[1]} CUs name no "
              f"device (written before the column): they stand for every such GPU, and this run neither skips "
              f"(--skip-done) nor replaces them; to make them {kind[2]}'s, write the name of the GPU that timed them "
              "into their device column", flush=True)
    usable = {}  # shape key -> candidates with a usable row of this GPU
    seen = {}  # shape key -> candidates with any row of this GPU
    for r in measured:
        if core.gpu_kind(r) != kind:
            continue
        key, name, ok = shape_key(schema, r), candidate_of(schema, r).name, core.usable(schema, r)
        seen.setdefault(key, set()).add(name)
        if ok:
            usable.setdefault(key, set()).add(name)
        # (a candidate rejected for an error is measured again: the error may have been the machine's)
        if skip_done and (ok or core.settled(schema, r)):
            done.setdefault(key, set()).add(name)
    jobs, same, dominated = [], 0, 0
    for i, shape in enumerate(shapes):
        pr = adapter.candidates(shape, info)
        key = shape_key(schema, shape)
        new = any(c.name not in seen.get(key, ()) for c in pr.kept)
        cands = pr.kept if new else [c for c in pr.kept if c.name not in done.get(key, ())]
        same, dominated = same + len(pr.same), dominated + len(pr.dominated)
        if pr.same or pr.dominated:
            summary.retired[kind + key] = set(pr.same) | set(pr.dominated)
        if not cands:
            summary.skipped += 1
            summary.complete.add(kind + key)
            continue
        jobs.append({"i": i, "shape": shape, "cands": [[c.variant, [list(p) for p in c.params]] for c in cands],
                     "est": adapter.estimate_s(shape, cands, info),
                     # a usable row among the candidates this run does not measure again: a choice whatever it gets
                     "chosen": bool(usable.get(key, set()) - {c.name for c in cands})})
    summary.planned = sum(len(j["cands"]) for j in jobs)
    summary.estimate_s = sum(j["est"] for j in jobs)
    gpu = f"{info['arch']} ({info['cu_count']} CUs{', ' + info['device'] if info.get('device') else ''})"
    print(f"hipkern.tune {adapter.op} on {gpu}: {len(jobs)} shapes to tune "
          f"({summary.skipped} of {len(shapes)} done already), {summary.planned} candidates ({same} same launches "
          f"and {dominated} dominated pruned); estimated GPU time {summary.estimate_s / 60:.1f} min", flush=True)
    return jobs, summary


def device_info(adapter, gpus, device=0) -> dict:
    """The adapter's facts about the GPU(s) a run uses; the GPUs of --gpus must be of one kind."""
    infos = [adapter.device_info(g) for g in (gpus or [device])]
    kinds = {core.gpu_kind(x) for x in infos}
    if len(kinds) > 1:
        raise ValueError(f"--gpus: the GPUs differ ({sorted(kinds)}): tune each kind separately")
    return infos[0]


def default_of(adapter):
    """A database or candidates row -> the name of its shape's heuristic default candidate."""
    return lambda row: adapter.heuristic(adapter.parse_shape(row),
                                         adapter.info_for(row["arch"], int(row["cu_count"]))).name


def tune(adapter, shapes, out, *, spec=None, gpus=None, device=0, skip_done=False, time_limit=None, progress=True,
         dry_run=False, info=None) -> Summary:
    """Tune `shapes` into `out` (see core). gpus: shard over one worker process per listed GPU (the
    adapter named by `spec`, importable there); else run here on `device`. Ctrl-C saves the finished
    rows, then raises KeyboardInterrupt; time_limit (s) stops starting new shapes after that long."""
    info = info or device_info(adapter, gpus, device)
    planning_gpu = (gpus or [device])[0]  # candidates ask the occupancy of a GPU of the kind tuned, not GPU 0
    on_gpu = torch.cuda.is_available() and planning_gpu < torch.cuda.device_count()  # (else a dry run, no GPU)
    with torch.cuda.device(planning_gpu) if on_gpu else contextlib.nullcontext():
        jobs, summary = plan(adapter, shapes, out, info, skip_done)
    if dry_run:
        return summary
    if not jobs:  # every shape measured before: make sure each has its database row
        summary.db_rows = core.save(adapter.schema, out, [], summary.complete, default_of(adapter), summary.retired)
        return summary
    run_stamp = core.stamp()
    run = Run(adapter, Path(out), jobs, info, run_stamp, summary, progress)
    deadline = None if time_limit is None else core._now() + time_limit
    interrupted = False
    try:
        if gpus:
            _run_workers(spec or adapter.op, run, jobs, gpus, info, run_stamp, deadline)
        else:
            try:
                core.run_jobs(adapter, sorted(jobs, key=lambda j: adapter.order(j["shape"])), info, device, run_stamp,
                              lambda ev: run.handle(ev, device), deadline)
            except DeviceLost as e:
                summary.crashes.append(str(e))
                run.progress.write(f"hipkern.tune: {e}")
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        run.finish(interrupted)
    return summary


def shard(jobs, n: int, order, last=frozenset()) -> list:
    """n lists of jobs balanced by estimated seconds (largest first onto the least loaded), each in
    the adapter's order, the shapes in `last` at the end (they were running when a worker crashed)."""
    loads, shards = [0.0] * n, [[] for _ in range(n)]
    for j in sorted(jobs, key=lambda j: -j["est"]):
        w = min(range(n), key=loads.__getitem__)
        shards[w].append(j)
        loads[w] += j["est"]
    return [sorted(s, key=lambda j: (j["i"] in last, order(j["shape"]))) for s in shards]


class _Worker:
    def __init__(self, spec, tmp, tag, gpu, jobs, info, run_stamp, deadline):
        self.gpu, self.jobs, self.pos = gpu, jobs, 0
        base = Path(tmp) / f"worker-{tag}"
        jpath, self.log, self.err = (base.with_suffix(s) for s in (".json", ".jsonl", ".out"))
        jpath.write_text(json.dumps({"info": info, "stamp": run_stamp, "jobs": jobs}))
        self.log.touch()
        cmd = [sys.executable, "-m", "hipkern.tune", "_worker", spec, "--jobs", str(jpath), "--log", str(self.log),
               "--device", str(gpu)]
        if deadline is not None:
            cmd += ["--deadline-s", f"{max(0.0, deadline - core._now()):.1f}"]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the workers import this very hipkern
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(self.err, "wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def events(self) -> list:
        with open(self.log, "rb") as fh:
            fh.seek(self.pos)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line cut short by a crash is never read
        self.pos += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]

    def tail(self, n: int = 12) -> str:
        return "\n".join("    " + x for x in self.err.read_text(errors="replace").splitlines()[-n:])


def _wait(workers, run) -> None:
    try:
        while True:
            alive = [w for w in workers if w.proc.poll() is None]
            for w in workers:
                for ev in w.events():
                    run.handle(ev, w)
            if not alive:
                return
            time.sleep(0.2)
    except KeyboardInterrupt:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGINT)
        for w in workers:
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            for ev in w.events():
                run.handle(ev, w)
        raise


def _run_workers(spec, run, jobs, gpus, info, run_stamp, deadline) -> None:
    """Two rounds: all jobs over all GPUs, then the unfinished ones of crashed workers (once)."""
    tmp = tempfile.mkdtemp(prefix="hipkern-tune-")
    try:
        pending = list(jobs)
        for attempt in (1, 2):
            last = {j["i"] for j in pending if j.get("suspect")}
            shards = shard(pending, len(gpus), run.adapter.order, last)
            workers = [_Worker(spec, tmp, f"{attempt}-{w}", g, s, info, run_stamp, deadline)
                       for w, (g, s) in enumerate(zip(gpus, shards)) if s]
            _wait(workers, run)
            pending = [j for w in workers if w.proc.returncode != 0 for j in run.after_crash(w)]
            if not pending or run.summary.stopped:
                return  # shapes a time limit left unfinished are for the next run (--skip-done)
            if attempt == 1:
                run.progress.write(f"hipkern.tune: retrying {len(pending)} shapes of crashed workers once")
        for j in pending:
            run.summary.failed[j["i"]] = "its worker crashed twice"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def worker_main(spec: str, jobs_path: str, log_path: str, device: int, deadline_s: float | None) -> int:
    """One worker process: tune the jobs of `jobs_path` on `device`, one JSON event per line to `log_path`."""
    payload = json.loads(Path(jobs_path).read_text())
    adapter = core.load_adapter(spec)
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    deadline = None if deadline_s is None else core._now() + deadline_s
    with open(log_path, "a") as log:
        def emit(ev):
            log.write(json.dumps(ev) + "\n")
            log.flush()

        try:
            core.run_jobs(adapter, payload["jobs"], payload["info"], device, payload["stamp"], emit, deadline)
        except KeyboardInterrupt:
            return 130
        except DeviceLost as e:
            print(f"hipkern.tune worker: {e}", file=sys.stderr, flush=True)
            return 3
    return 0
