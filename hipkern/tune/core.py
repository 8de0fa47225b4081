"""The tuner's op-independent core: candidates, measuring, result rows, merging and the run loop.

An op adapter (``hipkern/tune/<op>.py``, or any object named as ``module:attribute``) provides:

* ``op``, ``schema``: the op's name and its ``tuning_db.Schema`` (the columns of its rows);
* ``parse_shape(raw) -> dict``: a shape (the schema's exact and bucket keys) from a CSV or CLI row,
  ValueError naming the column when a value is bad; ``describe(shape)``: a short label;
* ``device_info(device) -> dict`` (JSON-able: at least ``arch`` and ``cu_count``) and
  ``info_for(arch, cu_count)``, the same facts without a GPU (dry runs, reports);
* ``heuristic(shape, info) -> Candidate``: what the op runs untuned on that GPU;
* ``candidates(shape, info) -> Pruned``: every applicable candidate, the heuristic first, candidates
  with the same launch as an earlier one (``same``) and dominated ones (``dominated``) removed;
* ``estimate_s(shape, candidates, info)``: GPU seconds to tune the shape; ``order(shape)``: sort key
  of a worker's shapes (to reuse inputs);
* ``prepare(shape, info, device) -> bench``: inputs and reference of one shape: ``nbytes``, ``tol``
  (rtol/atol), ``use(candidate)`` (a context in which the op runs that candidate), ``new_output()``,
  ``call(out)``, ``checked(out) -> (part of out, its reference)``, ``time_us()`` (perftest_us), and
  where the schema has ``measures``, ``time_measures() -> {measure: us}`` (the same candidate timed
  on other inputs: fused_moe's skewed routing).

Files: the database file (``tuning/results/<arch>/<op>.csv``, the schema's columns, the best row
per key) and next to it ``<op>.candidates.csv``: the latest measurement of every candidate of every
key, with ``status`` (ok / rejected) and ``note``. The database takes, per key, the lowest ``us``
among rows not rejected, ties to the newer date, then to the later row (this run's); it only takes
candidate rows of shapes whose candidates have all been measured. With measures, the first one is a
second objective: among the candidates within SECOND_WINDOW of the fastest, one that is faster on it
by more than DEFAULT_MARGIN is preferred (prefer_default).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import hashlib
import importlib
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .. import tuning_db
from ..jit._lock import file_lock
from ..jit._paths import cache_root
from ..testing import checkAllclose, poison, run_perftest

ADAPTERS = {"paged_attention": "hipkern.tune.paged_attention:ADAPTER", "fused_moe": "hipkern.tune.fused_moe:ADAPTER"}
STATUS_COLUMNS = ("status", "note")
CHECKPOINT_S = 30.0  # save finished rows at least this often
_now = time.monotonic  # tests replace it


@dataclasses.dataclass(frozen=True)
class Candidate:
    variant: str
    params: tuple = ()  # sorted (name, int) pairs

    @classmethod
    def of(cls, variant: str, **params) -> "Candidate":
        return cls(variant, tuple(sorted((k, int(v)) for k, v in params.items())))

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    @property
    def name(self) -> str:
        return self.variant + ("[" + ",".join(f"{k}={v}" for k, v in self.params) + "]" if self.params else "")


@dataclasses.dataclass
class Pruned:
    kept: list  # Candidates to time, in enumeration order
    same: dict = dataclasses.field(default_factory=dict)  # name -> name of the first with the same launch
    dominated: dict = dataclasses.field(default_factory=dict)  # name -> name of a candidate that dominates it


def dedupe(items) -> tuple:
    """items: (Candidate, launch key) in enumeration order -> (kept, {name: first name with that launch})."""
    first, kept, same = {}, [], {}
    for cand, launch in items:
        if launch in first:
            if cand.name != first[launch].name:
                same[cand.name] = first[launch].name
            continue
        first[launch] = cand
        kept.append((cand, launch))
    return kept, same


def load_adapter(spec: str):
    """The adapter of a built-in op ('paged_attention') or of 'module:attribute'."""
    path = ADAPTERS.get(spec, spec)
    if ":" not in path:
        raise ValueError(f"op must be one of {sorted(ADAPTERS)} or 'module:attribute', got {spec!r}")
    module, _, attr = path.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    return obj() if isinstance(obj, type) else obj


def arch_info(arch: str, cu_count: int) -> dict:
    """An adapter's info_for: the facts of a GPU that candidates depend on, without one (its device name
    unknown: "")."""
    from .. import jit
    arch = jit.platform.check_arch(arch)  # the canonical name (sm_90a is sm_90): the results' folder
    return {"arch": arch, "cu_count": int(cu_count), "device": "", "wave": jit.wave_size_of(arch)}


def gpu_kind(row) -> tuple:
    """(arch, cu_count, device) of a row or an info: the GPUs whose timings are comparable (tuning_db keeps
    each device's rows apart; a row without a device stands for any)."""
    return str(row["arch"]), int(row["cu_count"]), str(row.get("device") or "").strip()


def gpu_info(device) -> dict:
    """An adapter's device_info: arch_info of GPU `device`, plus its memory."""
    from .. import jit
    if not torch.cuda.is_available():
        raise ValueError("no GPU is visible to torch: tuning needs one (--dry-run --arch A --cu-count N plans "
                         "without)")
    arch, own = jit.platform.built_and_device_arch(device)
    if arch != own:  # HIPKERN_ARCH=sm_80 on an H100 runs sm_80 modules through their PTX: timings of neither
        raise ValueError(f"HIPKERN_ARCH={os.environ.get('HIPKERN_ARCH')} builds for {arch}, but GPU {device} is "
                         f"{own}: its timings would be filed as {arch}'s results; tune on a GPU of that arch, or "
                         "unset HIPKERN_ARCH")
    props = torch.cuda.get_device_properties(device)
    return {**arch_info(arch, props.multi_processor_count), "device": props.name, "memory": props.total_memory}


def checkout_dir() -> Path:
    """tuning/ of the hipkern checkout this package runs from (the tuner writes there by default)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "tuning").is_dir() or not (root / "hipkern").is_dir():
        raise ValueError(f"{root} is not a hipkern checkout (an installed hipkern): pass --out FILE for the "
                         "tuned rows (HIPKERN_TUNING_DB=FILE then overlays them on the shipped database)")
    return root / "tuning"


def shipped_tuning_dir() -> Path:
    """The shipped shapes and results (read only): tuning/ of a checkout, hipkern/_tuning of a wheel."""
    return tuning_db.shipped_results_dir().parent


# ---- shapes ---------------------------------------------------------------------------------------

def parse_shapes(adapter, raws, where: dict | None = None) -> list:
    """Shapes from (label, raw row) pairs: schema keys present, buckets powers of two, deduplicated.
    Rows of an untuned-log file (an ``op`` column) count only when they name this op."""
    schema, shapes, seen = adapter.schema, [], set()
    for label, raw in raws:
        if raw.get("op") not in (None, "", adapter.op):
            continue
        missing = [k for k in schema.exact_keys + schema.bucket_keys if raw.get(k) in (None, "")]
        try:
            if missing:
                raise ValueError(f"missing {missing}")
            for k in schema.bucket_keys:
                v = str(raw[k]).strip()
                if not v.isdigit() or int(v) < 1 or int(v) & (int(v) - 1):
                    raise ValueError(f"{k}={raw[k]!r} must be a power of two (a tuning bucket)")
            shape = adapter.parse_shape(raw)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        if where and any(str(shape.get(k)) != v for k, v in where.items()):
            continue
        key = shape_key(schema, shape)
        if key not in seen:
            seen.add(key)
            shapes.append(shape)
    return shapes


def read_shapes(adapter, path=None, specs=(), where=None) -> list:
    """--shapes CSV (default tuning/shapes/<op>.csv unless --shape is given) plus --shape k=v,... rows."""
    raws = []
    if path is not None or not specs:
        path = Path(path) if path is not None else shipped_tuning_dir() / "shapes" / f"{adapter.op}.csv"
        if not path.is_file():
            raise ValueError(f"--shapes: {path} does not exist")
        raws += [(f"{path} line {n}", r) for n, r in read_csv_lines(path)]
    for s in specs:
        pairs = [p.split("=", 1) for p in s.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"--shape must be key=value,key=value,...; got {s!r}")
        raws.append((f"--shape {s!r}", {k.strip(): v.strip() for k, v in pairs}))
    known = set(adapter.schema.exact_keys + adapter.schema.bucket_keys)
    if where and not set(where) <= known:
        raise ValueError(f"--where keys must be among {sorted(known)}, got {sorted(set(where) - known)}")
    shapes = parse_shapes(adapter, raws, where)
    if not shapes:
        raise ValueError(f"no {adapter.op} shapes selected (--shapes {path}, --shape {list(specs)}, --where {where})")
    return shapes


# ---- rows and files -------------------------------------------------------------------------------

def shape_key(schema, shape) -> tuple:
    """Exact keys stripped, as the lookup reads them (tuning_db): a hand-edited "bfloat16 " is bfloat16."""
    return tuple(str(shape[k]).strip() for k in schema.exact_keys) + tuple(int(shape[k]) for k in schema.bucket_keys)


def row_key(schema, row) -> tuple:
    return gpu_kind(row) + shape_key(schema, row)


def candidate_of(schema, row) -> Candidate:
    return Candidate(row["variant"], tuple((k, int(row[k])) for k in sorted(schema.param_keys)
                                           if str(row.get(k, "")) != ""))


def _git(root: Path, *args) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def stamp() -> dict:
    """Date and commit written into every row of a run: the checkout's HEAD, with "-dirty" when the code that
    runs (hipkern/, csrc_hip/) has changes not committed; empty when hipkern is not a checkout of its own (an
    installed wheel, also one inside another repository)."""
    root = Path(__file__).resolve().parents[2]
    top = _git(root, "rev-parse", "--show-toplevel")
    commit = ""
    if top and Path(top).resolve() == root.resolve():
        commit = _git(root, "rev-parse", "--short=12", "HEAD") or ""
        if commit and _git(root, "status", "--porcelain", "--", "hipkern", "csrc_hip"):
            commit += "-dirty"
    if not commit:
        print(f"hipkern.tune: {root} is not a git checkout of hipkern: rows get an empty commit", flush=True)
    return {"date": datetime.date.today().isoformat(), "commit": commit}


def make_row(schema, info, shape, cand, status, us, nbytes, err, note, run_stamp, measures=None) -> dict:
    extra = set(cand.kwargs) - set(schema.param_keys)
    if extra:
        raise ValueError(f"candidate {cand.name}: parameters {sorted(extra)} are not columns of {schema.op}")
    row = {"arch": info["arch"], "cu_count": info["cu_count"], "device": info.get("device", ""),
           "variant": cand.variant, "us": "" if us is None else f"{us:.3f}",
           "tbps": "" if us is None else f"{nbytes / us / 1e6:.4f}",
           "err": "" if err is None else f"{err:.3g}", **run_stamp}
    row.update({k: shape[k] for k in schema.exact_keys + schema.bucket_keys})
    row.update({k: cand.kwargs.get(k, "") for k in schema.param_keys})
    row.update({k: f"{measures[k]:.3f}" if measures and k in measures else "" for k in schema.measures})
    row.update(status=status, note=" ".join(str(note).split())[:300])
    return row


def read_csv_lines(path) -> list:
    """[(line, row)] of a CSV file, line as in the file (blank lines count); [] when it does not exist."""
    if not Path(path).is_file():
        return []
    with open(path, newline="", encoding="utf-8-sig") as fh:  # (-sig: a byte-order mark, as tuning_db reads it)
        reader = csv.DictReader(fh)
        return [(reader.line_num, r) for r in reader]


def write_csv(path, rows, columns) -> None:
    """Written to a temporary file of its own next to `path`, then renamed over it: a reader or a killed
    writer never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it (mkstemp's file is 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def files_lock(out):
    """An inter-process lock over the read-merge-write of a database file and its candidates file (save):
    two tuners saving into the same files take turns instead of losing each other's rows. The lock file
    lives in the user's private JIT cache (jit._paths.cache_root: not the shared temporary directory, where
    another user could plant a link or hold the lock), named by the database's path."""
    name = hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:16]
    locks = cache_root() / "tune-locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    path = locks / f"{name}.lock"
    with file_lock(path, f"saving tuning results into {out}"):
        try:
            yield
        finally:  # removed while held, so none pile up: a waiter on it finds it gone and takes a new one (file_lock)
            path.unlink(missing_ok=True)


def candidates_path(out) -> Path:
    out = Path(out)
    return out.with_name(out.stem + ".candidates.csv")


def _load(schema, path) -> list:
    lines = read_csv_lines(path)
    for n, r in lines:
        try:
            row_key(schema, r), candidate_of(schema, r)
            if r.get("status", "ok") in ("ok", "", None):
                times = [float(r["us"])] + [float(r[k]) for k in schema.measures if r.get(k) not in ("", None)]
                if not all(math.isfinite(t) and t > 0 for t in times):
                    raise ValueError(f"a time is not positive: {times}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}, line {n}: not a {schema.op} tuning row ({type(e).__name__}: {e})") from None
    return [r for _, r in lines]


class WrongResult(ValueError):
    """A candidate's output is wrong (an adapter's own check, e.g. under another routing): measure() records it
    as rejected, and --skip-done does not measure it again (as a checkAllclose mismatch)."""


# The note of a candidate after which the GPU was unusable (a sticky fault: the process had to end).
GPU_FAULT = "the GPU was unusable after it"


def settled(schema, r) -> bool:
    """Whether --skip-done leaves a measured candidate alone: a usable row, one rejected for a wrong result (that
    repeats), or one that left the GPU unusable (measured again, it would end every run here before the candidates
    after it); a candidate rejected for another error (a toolchain, memory, a crashed worker) is measured again."""
    note = str(r.get("note") or "")
    return usable(schema, r) or (note.startswith(("checkAllclose mismatch", f"{WrongResult.__name__}: ", GPU_FAULT))
                                 or "output elements non-finite" in note)


def usable(schema, r) -> bool:
    """Whether a row may be chosen: not rejected, and one the op's database would take (its variant and
    parameters as the op runs them now: tuning_db.parse_row, which the loader applies too), so that the tuner
    never writes a row the loader would skip while a slower valid one is dropped."""
    if r.get("status", "ok") not in ("ok", "", None) or r["variant"] not in schema.variants:
        return False
    raw = {k: v if v is None or isinstance(v, str) else str(v) for k, v in r.items()}
    return isinstance(tuning_db.parse_row(schema, raw, str(r.get("arch", "")).strip()), dict)


def merge_best(schema, rows) -> list:
    """The best row per key: lowest us among usable rows; ties go to the newer date, then to the later
    row. Sorted by key."""
    best = {}
    for r in rows:
        if not usable(schema, r):
            continue
        k, us = row_key(schema, r), float(r["us"])
        cur = best.get(k)
        if cur is None or us < float(cur["us"]) or (us == float(cur["us"]) and r.get("date", "") >= cur.get("date", "")):
            best[k] = r
    return [best[k] for k in sorted(best)]


# The heuristic default (what the op runs without a row) keeps a shape unless another candidate is
# faster by more than this: a tuner run's timing noise, so that a tie is not settled by noise.
DEFAULT_MARGIN = 0.02
# With a second measure (Schema.measures; fused_moe: skewed routing), a candidate this close to the
# fastest may be chosen for being faster there by more than DEFAULT_MARGIN: up to 4 % of the first
# measure's speed traded for robustness (fused_moe, bf16 DeepSeek-like 16 tokens on the H100:
# block_m 16 is 2.1 % slower than 8 under uniform routing and 21 % faster under skewed routing). At
# 5 % it took block_m 128 for bf16 8192 x 16384 x 128 tokens (4.6 % slower uniform, 10 % faster
# skewed), which put the benchmark's uniform case (30) under the 2.8 TB/s.
SECOND_WINDOW = 0.04
# ... and only where the second measure gains at least this many times what the first loses: a trade of
# 3.8 % uniform for 2.1 % skewed is not robustness (fused_moe, bf16 8192 x 6144 x 128 tokens on the
# H100 with block_m 128's copy barriers, 2026-11-27: it would have put the benchmark's uniform case 28
# under the 2.8 TB/s); 3.3 % for 9.2 % at 8192 x 16384 x 128 tokens is.
SECOND_EXCHANGE = 2.0


def prefer_default(schema, rows, default_of) -> list:
    """`rows` (one key's latest measurements) reduced to the default's row when that is within
    DEFAULT_MARGIN of the fastest; default_of(row) names the key's default candidate. Then, where the
    schema has measures and every candidate within SECOND_WINDOW of the fastest was timed on the first
    one (fused_moe: skewed routing), the fastest there of those that beat that choice (the default,
    else the fastest) there by more than DEFAULT_MARGIN and by more than SECOND_EXCHANGE times what
    they lose on us (second_trade) replaces it."""
    ok = [r for r in rows if usable(schema, r)]
    if not ok:
        return rows
    best = min(float(r["us"]) for r in ok)
    near = [r for r in ok if float(r["us"]) <= best * (1 + DEFAULT_MARGIN)]
    name = default_of(ok[0]) if default_of is not None else None
    default = [r for r in near if candidate_of(schema, r).name == name]
    second = schema.measures[0] if schema.measures else None
    window = [r for r in ok if float(r["us"]) <= best * (1 + SECOND_WINDOW)]
    if second is None or any(r.get(second) in ("", None) for r in window):
        return default or rows
    base = default[0] if default else min(near, key=lambda r: float(r["us"]))
    trades = [r for r in window if second_trade(base, r, second)]
    return [min(trades, key=lambda r: float(r[second])) if trades else base]


def second_trade(base, alt, second) -> bool:
    """Whether row `alt` replaces `base` for its second measure: faster there by more than DEFAULT_MARGIN
    and by more than SECOND_EXCHANGE times its relative loss on us (a gain on both always does)."""
    gain = float(base[second]) / float(alt[second]) - 1
    loss = float(alt["us"]) / float(base["us"]) - 1
    return gain > DEFAULT_MARGIN and gain > SECOND_EXCHANGE * loss


def save(schema, out, new_rows, complete_keys, default_of=None, retired=None) -> int:
    """Merge `new_rows` into the candidates file (latest row per key and candidate) and the rows of
    `complete_keys` into the database file; returns the database's row count. A database row whose
    candidate `new_rows` measured again is replaced by that measurement (the code it timed may have
    changed since), so a re-tune chooses among current times; rows of candidates not measured again
    (another machine's, added by hand) still compete with them, under the same rule, except those of
    `retired` ({key: names}: the candidates this run pruned for that shape, as the same launch as another or
    dominated: an old time of theirs would compete with the launch's new one). With default_of (a row -> the
    name of its shape's heuristic default candidate), a key's default wins within DEFAULT_MARGIN. Rows of other
    shapes are kept as they are, also those this checkout cannot use (another version's variant or
    parameters: a warning counts them)."""
    with files_lock(out):
        return _save(schema, out, new_rows, complete_keys, default_of, retired or {})


_SAID_FOREIGN: set = set()


def _save(schema, out, new_rows, complete_keys, default_of, retired) -> int:
    cpath = candidates_path(out)
    latest = {}
    for r in _load(schema, cpath) + list(new_rows):
        latest[(row_key(schema, r), candidate_of(schema, r).name)] = r
    rows = [latest[k] for k in sorted(latest)]
    write_csv(cpath, rows, schema.columns + STATUS_COLUMNS)

    def competes(r) -> bool:
        return candidate_of(schema, r).name not in retired.get(row_key(schema, r), ())

    # Only shapes measured to the end replace their rows: an interrupted re-tune (Ctrl-C, a worker lost,
    # a checkpoint while other workers still measure) keeps the shape's old row until a new one is chosen.
    again = {(row_key(schema, r), candidate_of(schema, r).name) for r in new_rows
             if row_key(schema, r) in complete_keys}
    kept = [r for r in _load(schema, out) if (row_key(schema, r), candidate_of(schema, r).name) not in again]
    per_key = {}
    for r in rows:
        if row_key(schema, r) in complete_keys and competes(r):
            per_key.setdefault(row_key(schema, r), []).append(r)
    # A complete key's surviving database row joins its candidates before the default's margin is
    # applied (it could otherwise beat the default by less than the margin after it).
    for r in kept:
        k = row_key(schema, r)
        if k in per_key and (k, candidate_of(schema, r).name) not in latest and competes(r):
            per_key[k].append(r)
    # A complete key none of whose rows may be chosen (every candidate rejected this time: a toolchain, the
    # GPU's memory) keeps the rows the database had for it (the runner reports the shape as failed).
    dead = {k for k, rs in per_key.items() if not any(usable(schema, r) for r in rs)}
    kept = [r for r in kept if row_key(schema, r) not in per_key]
    kept += [r for r in _load(schema, out) if row_key(schema, r) in dead]
    chosen = [r for k in sorted(per_key) if k not in dead for r in prefer_default(schema, per_key[k], default_of)]
    db = merge_best(schema, kept + chosen)
    # Rows of untouched shapes that this checkout cannot use stay (a newer checkout's variant): dropping them
    # would lose committed rows of shapes this run never tuned.
    have = {row_key(schema, r) for r in db}
    foreign = [r for r in kept if not usable(schema, r) and row_key(schema, r) not in have]
    if foreign and (str(out), len(foreign)) not in _SAID_FOREIGN:  # (once, not at every checkpoint)
        _SAID_FOREIGN.add((str(out), len(foreign)))
        print(f"hipkern.tune: {out} keeps {len(foreign)} rows of other shapes that this checkout's {schema.op} "
              f"cannot use (a variant or parameters it does not know: another version's?); the op skips them",
              flush=True)
        db = sorted(db + foreign, key=lambda r: row_key(schema, r))
    write_csv(out, db, schema.columns)
    return len(db)


# ---- measuring --------------------------------------------------------------------------------------

class DeviceLost(RuntimeError):
    """A candidate left the GPU unusable (a fault): the process must end; its rows so far are kept."""


def perftest_us(fn, *args, iters: int, warmup: int, **kwargs) -> float:
    """Median device microseconds of fn(*args) by hipkern.testing.run_perftest (events, warm-up,
    rotated inputs or an L2 flush before each call)."""
    return run_perftest(fn, *args, num_iters=iters, num_warmup=warmup, **kwargs)[1]


def output_errors(out, got, ref, tol: dict) -> tuple:
    """(non-finite elements of the NaN-poisoned output `out`, checkAllclose's mismatch share of `got`, the checked
    part of it, against `ref`): a candidate's output is right where both are 0."""
    return int((~torch.isfinite(out)).sum()), checkAllclose(got, ref, printLog=False, **tol)


def measure(bench, cand, measures=()) -> tuple:
    """(status, us, err, note, fatal, {measure: us}): run `cand` once into a NaN-poisoned output,
    reject it on any non-finite element or a checkAllclose mismatch against the reference, else time
    it (and, with `measures`, bench.time_measures()); then run it once more into another poisoned output and
    reject it unless that has the checked output's bits (the ops are deterministic: a candidate whose timed
    calls left state behind, or that writes less or other values on a later call, is not chosen)."""
    try:
        with bench.use(cand):
            out = poison(bench.new_output())
            bench.call(out)
            got, ref = bench.checked(out)
            bad, err = output_errors(out, got, ref, bench.tol)
            if bad:
                return ("rejected", None, 1.0, f"{bad} of {out.numel()} output elements non-finite (NaN-poisoned "
                        "output)", False, {})
            if err > 0:
                checkAllclose(got, ref, msg=f"{cand.name} rejected: ", **bench.tol)
                return "rejected", None, err, f"checkAllclose mismatch on {err:.2%} of the checked elements", False, {}
            us = float(bench.time_us())
            extra = {k: float(v) for k, v in bench.time_measures().items()} if measures else {}
            again = poison(bench.new_output())
            bench.call(again)
            if not torch.equal(again, out):
                return ("rejected", None, err, f"a call after timing differs from the checked one in "
                        f"{int((again != out).sum())} of {out.numel()} output elements (not repeatable)", False, {})
        if set(extra) != set(measures):
            return "rejected", None, err, f"time_measures gave {sorted(extra)}, not {sorted(measures)}", False, {}
        bad_times = {k: v for k, v in {"us": us, **extra}.items() if not (math.isfinite(v) and v > 0)}
        if bad_times:
            return "rejected", None, err, f"timing gave {bad_times}", False, {}
        return "ok", us, err, "", False, extra
    except KeyboardInterrupt:
        raise
    except Exception as e:  # the candidate fails: recorded as rejected, never chosen
        fatal = not _device_usable()
        return "rejected", None, None, f"{GPU_FAULT + ': ' if fatal else ''}{type(e).__name__}: {e}", fatal, {}


def _device_usable() -> bool:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # a sticky fault: every later launch on this context would fail too
        return False


def run_jobs(adapter, jobs, info, device, run_stamp, emit, deadline=None) -> None:
    """Tune `jobs` ({i, shape, cands}) in order on `device`, reporting through emit(event): shape, begin,
    row, done, failed (the shape could not be prepared) and stop (the deadline passed)."""
    schema = adapter.schema
    for job in jobs:
        if deadline is not None and _now() >= deadline:
            emit({"ev": "stop", "reason": "time limit"})
            return
        i, shape, t0 = job["i"], job["shape"], _now()
        emit({"ev": "shape", "i": i})
        try:
            bench = adapter.prepare(shape, info, device)
        except KeyboardInterrupt:
            raise
        except Exception as e:
            emit({"ev": "failed", "i": i, "note": f"preparing inputs failed: {type(e).__name__}: {e}"})
            if not _device_usable():
                raise DeviceLost(f"the GPU is unusable after preparing {adapter.describe(shape)}") from e
            continue
        for variant, params in job["cands"]:
            cand = Candidate(variant, tuple(tuple(p) for p in params))
            emit({"ev": "begin", "i": i, "cand": cand.name})
            status, us, err, note, fatal, extra = measure(bench, cand, schema.measures)
            emit({"ev": "row", "i": i, "row": make_row(schema, info, shape, cand, status, us, bench.nbytes, err,
                                                       note, run_stamp, extra)})
            if fatal:
                raise DeviceLost(f"the GPU is unusable after {cand.name} on {adapter.describe(shape)}: "
                                 f"{note.removeprefix(GPU_FAULT + ': ')}")
        del bench
        emit({"ev": "done", "i": i, "s": _now() - t0})
