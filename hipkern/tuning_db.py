"""The tuning database: which variant (and parameters) each op uses for each shape.

Files: ``tuning/results/<arch>/<op>.csv`` shipped with hipkern (inside a wheel: hipkern/_tuning),
overlaid row by row by the user's files in ``HIPKERN_TUNING_DB=path[:path...]`` (later files win
on the same key; within one file the fastest row of a key, then the newest, as the tuner merges; a
file named in the variable that holds another op's columns is that op's alone). Each op declares a
:class:`Schema`: its shape keys that must match exactly (dtype, head size, layout, ...), its bucket
keys (powers of two: batch, context length, tokens), its variant-parameter columns, and optionally
further timings of the chosen candidate under other inputs (``measures``: fused_moe's ``skewed_us``,
every token routed to the same experts). Every file also has the columns ``arch, cu_count, variant,
us, tbps, err, date, commit``, and optionally ``device``: the GPU's name as torch gives it ("NVIDIA H100
80GB HBM3", "NVIDIA H200", "AMD Instinct MI300X"). GPUs of one arch and CU count can differ in memory
bandwidth (H100 and H200: sm_90, 132 SMs; MI300X and MI325X: gfx942, 304 CUs), so rows of two devices are
kept apart, and a device's tuner run never replaces another device's rows. A row without a device (a file
from before the column) stands for any GPU of its arch and CU count: in a later file it replaces the earlier
files' rows of its shape and CU count whatever their device, as such a file did before the column.

Lookup (``lookup(op, arch, cu_count, device_name=..., **shape)``), in this order:

1. exact: a row with the same exact keys, the same buckets, the same cu_count and this GPU's device
   (else such a row without a device);
2. nearest: among rows with the same exact keys, the smallest distance, where distance is the sum
   over bucket keys of |log2(a) - log2(b)|, plus 0.5 when cu_count differs and 0.25 when the row is
   another device's (an H200 takes an H100's row of its own shape before its own row of a shape one
   bucket away); ties go to the row with the larger buckets (tuned for more work), then to this GPU's own
   row, then to one device throughout (the one with the most rows, then by name: a GPU with no rows of its
   own takes one device's choices, not a mix), then to the newer date, then to the nearer cu_count (then the
   larger), so that the choice never depends on the order of the files' rows;
3. none: the op uses its heuristic default.

A file that replaces rows of earlier files (a user's row shadowing a shipped one) says so once, with the
count and one example (logger ``hipkern.tuning``, level INFO).

Cases 2 and 3 are logged once per shape (logger ``hipkern.tuning``, level INFO), and with
``HIPKERN_LOG_UNTUNED=path`` appended to that CSV as rows of shape keys (and the GPU's name), ready for
the tuner (an op whose columns differ from the file's header, e.g. the second op a process logs, appends
to ``<stem>.<op>.csv`` beside it); a log file that cannot be written warns once per path, and the op
still runs. A file that cannot be read, is empty, is not comma-separated or lacks columns, and a row with
a bad value (an exact key the op does not take or names otherwise, e.g. "fp16" or "64.0": it could never
match), a variant the op no longer has or parameters the op cannot run (its Schema.check), is skipped with
one warning naming the file (and line); the op still runs. A path in ``HIPKERN_TUNING_DB`` that does not
exist, or a folder there without ``<arch>/<op>.csv``, is skipped with a warning too (each op looked up on
the arch names its own missing file); a shipped file that does not exist is skipped silently (no rows of
that op and arch are shipped). A file named in the variable with another op's columns is skipped silently;
``<folder>/<arch>/<op>.csv`` is that op's by its name, so missing columns there are warned about. A
byte-order mark (as spreadsheets save CSV) is ignored.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import logging
import math
import os
import threading
import warnings
from pathlib import Path

__all__ = ["Schema", "Choice", "register", "lookup", "bucket", "shipped_results_dir", "reset", "positive_ints",
           "parse_row", "generation"]

log = logging.getLogger("hipkern.tuning")
COMMON = ("arch", "cu_count", "variant", "us", "tbps", "err", "date", "commit")
DEVICE = "device"  # optional in a file (see above); written by the tuner after cu_count


@dataclasses.dataclass(frozen=True)
class Schema:
    op: str
    exact_keys: tuple  # must match; compared as strings
    bucket_keys: tuple  # powers of two; may differ (nearest neighbour)
    param_keys: tuple  # variant parameters (int, or empty for the variant's default)
    variants: frozenset  # variant names the op has now
    param_ranges: dict = dataclasses.field(default_factory=dict)  # param -> (lo, hi), inclusive
    # Further timings (us) of a candidate, optional in a file; the tuner weighs the first one too
    # (hipkern/tune/core.py, prefer_default).
    measures: tuple = ()
    # The op's own check of a parsed row (variant, "params", exact keys as strings): None if the op can
    # run it, else why not (the row is then skipped with a warning, as a row with a bad value is).
    check: object = dataclasses.field(default=None, compare=False)

    @property
    def columns(self) -> tuple:
        common = COMMON[:2] + (DEVICE,) + COMMON[2:]
        return common + self.exact_keys + self.bucket_keys + self.param_keys + self.measures


@dataclasses.dataclass(frozen=True)
class Choice:
    variant: str
    params: dict
    source: str  # "exact" or "nearest"
    row: dict


def bucket(n: int) -> int:
    """The power-of-two bucket of a size: the smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (math.ceil(n) - 1).bit_length()


def positive_ints(row: dict, keys) -> str | None:
    """For an op's Schema.check: why one of the exact `keys` of a parsed row is not a positive integer as
    lookup names it (exact keys match as strings: "64.0" or "064" would never match 64), or None."""
    for k in keys:
        v = row[k]
        if not (v.isascii() and v.isdigit()) or v != str(int(v)) or v == "0":
            return f"{k}={v!r} is not a positive integer (digits, no leading zero)"
    return None


def shipped_results_dir() -> Path:
    """tuning/results of a checkout, or hipkern/_tuning/results inside an installed wheel."""
    pkg = Path(__file__).resolve().parent
    for cand in (pkg / "_tuning" / "results", pkg.parent / "tuning" / "results"):
        if cand.is_dir():
            return cand
    return pkg / "_tuning" / "results"


def parse_row(s: Schema, raw: dict, arch: str):
    """A raw CSV row of `arch` as the lookup takes it (numbers parsed, "params" collected, keys stripped), or why
    it cannot be taken (a str): the loader skips such rows with a warning, and the tuner never chooses one."""
    if None in raw or any(v is None for v in raw.values()):  # csv's fill for a short or a long row
        return "the row has fewer or more fields than the header"
    if raw.get("arch", "").strip() != arch:
        return f"arch {raw.get('arch')!r} is not {arch!r}"
    if raw.get("variant") not in s.variants:
        return f"variant {raw.get('variant')!r} is not one of {sorted(s.variants)}"
    row = dict(raw, arch=arch)  # (" gfx942" matched after stripping: the op's own check reads the name)
    row[DEVICE] = (raw.get(DEVICE) or "").strip()
    try:
        row["cu_count"] = int(raw["cu_count"])
        for k in s.bucket_keys:
            row[k] = int(raw[k])
            if row[k] < 1 or row[k] & (row[k] - 1):
                return f"{k}={raw[k]!r} is not a power of two"
        row["params"] = {k: int(raw[k]) for k in s.param_keys if raw.get(k) not in ("", None)}
        us = float(raw["us"])
    except (TypeError, ValueError):
        return "a number column holds something else"
    if not (math.isfinite(us) and us > 0):
        return f"us={raw['us']!r} is not a positive time"
    for k, v in row["params"].items():
        lo, hi = s.param_ranges.get(k, (-math.inf, math.inf))
        if not lo <= v <= hi:
            return f"{k}={v} is outside [{lo}, {hi}]"
    for k in s.exact_keys:
        row[k] = raw[k].strip()
        if not row[k]:
            return "an exact key is empty"
    if s.check is not None:
        why = s.check(row)
        if why:
            return why
    return row


_schemas: dict = {}
_tables: dict = {}  # (op, arch) -> _Table
_lock = threading.Lock()


def register(schema: Schema) -> None:
    _schemas[schema.op] = schema


_generation = [0]  # counts reset()s: callers that memoise what a lookup chose key on it


def generation() -> int:
    """How many times reset() has run: a cache of lookup results is stale once this changes."""
    return _generation[0]


def reset() -> None:
    """Forget loaded files and memoised lookups (tests; after changing HIPKERN_TUNING_DB)."""
    with _lock:
        _tables.clear()
        _memo.clear()
        _log_failed.clear()
        _generation[0] += 1


class _Table:
    def __init__(self, schema: Schema, arch: str):
        self.schema = schema
        self.exact: dict = {}  # full key -> row
        self.groups: dict = {}  # exact keys -> [rows]
        files = [(shipped_results_dir() / arch / f"{schema.op}.csv", False)]  # (path, named in the variable)
        files += [(Path(p) / arch / f"{schema.op}.csv", False) if Path(p).is_dir() else (Path(p), True)
                  for p in os.environ.get("HIPKERN_TUNING_DB", "").split(os.pathsep) if p]
        for i, (f, named) in enumerate(files):
            self._load(f, arch, user=i > 0, named=named)
        for row in self.exact.values():
            self.groups.setdefault(self._exact_part(row), []).append(row)
        # Among other devices' rows that tie, one device throughout (the one with the most rows, then by name),
        # so that a GPU with none of its own (an H100 NVL, a GH200) takes one device's choices, not a mix of two
        # by the rows' dates.
        counts = collections.Counter(row[DEVICE] for row in self.exact.values())
        self.device_rank = {d: i for i, d in enumerate(sorted(counts, key=lambda d: (-counts[d], d)))}

    def _exact_part(self, row) -> tuple:
        return tuple(str(row[k]) for k in self.schema.exact_keys)

    def key(self, row) -> tuple:
        return (self._exact_part(row), tuple(int(row[k]) for k in self.schema.bucket_keys), int(row["cu_count"]),
                row[DEVICE])

    def _load(self, path: Path, arch: str, user: bool, named: bool = False) -> None:
        """Load `path`'s rows of `arch` (`user`: one of HIPKERN_TUNING_DB's; `named`: a file the variable names
        itself, which may be another op's, rather than <folder>/<arch>/<op>.csv, whose name says its op)."""
        if not path.is_file():
            if user:
                warnings.warn(f"hipkern tuning file {path} does not exist; skipped", stacklevel=4)
            return
        try:
            with open(path, newline="", encoding="utf-8-sig") as fh:  # (-sig: a byte-order mark, as Excel saves)
                reader = csv.DictReader(fh)
                # a parameter or measure column a file lacks (written before it existed) reads as empty
                have = reader.fieldnames or ()
                if not have:
                    warnings.warn(f"hipkern tuning file {path} is empty (no header on its first line); skipped",
                                  stacklevel=4)
                    return
                if not any(c in have for c in COMMON):  # e.g. ';'-separated: the header is one unknown column
                    warnings.warn(f"hipkern tuning file {path} has no tuning columns in its header "
                                  f"({','.join(have)[:80]!r}: not comma-separated?); skipped", stacklevel=4)
                    return
                missing = [c for c in self.schema.columns if c not in have
                           and c not in self.schema.param_keys + self.schema.measures + (DEVICE,)]
                if (named and all(k in missing for k in self.schema.bucket_keys)
                        and any(k in missing for k in self.schema.exact_keys)):
                    log.debug("hipkern: tuning file %s is not a %s file; skipped for it", path, self.schema.op)
                    return  # another op's file (HIPKERN_TUNING_DB may name one file per op)
                if missing:
                    warnings.warn(f"hipkern tuning file {path} lacks columns {missing}; skipped", stacklevel=4)
                    return
                rows = [(reader.line_num, raw) for raw in reader]  # the file's line (blank lines count)
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            warnings.warn(f"hipkern tuning file {path} cannot be read ({e}); skipped", stacklevel=4)
            return
        mine, dups, foreign = {}, 0, 0
        for line, raw in rows:
            if raw.get("arch") and raw["arch"].strip() != arch:  # a file may hold several archs' rows (--out)
                foreign += 1
                continue
            row = self._parse(raw, arch)
            if isinstance(row, str):
                warnings.warn(f"hipkern tuning file {path}, line {line}: {row}; row skipped", stacklevel=4)
                continue
            k = self.key(row)
            cur = mine.get(k)
            dups += cur is not None
            # Within a file, the tuner's rule (hipkern/tune/core.py merge_best): the lowest us, then the
            # newer date, then the later row.
            if cur is None or (float(row["us"]), _date_rank(row.get("date") or "")) <= (
                    float(cur["us"]), _date_rank(cur.get("date") or "")):
                mine[k] = row
        if foreign and path.parent.name == arch:  # a file of the per-arch layout: those rows are misplaced
            warnings.warn(f"hipkern tuning file {path} has {foreign} rows of other archs than {arch}; skipped",
                          stacklevel=4)
        elif foreign:  # one file of several archs' rows (HIPKERN_TUNING_DB naming the tuner's --out)
            log.debug("hipkern: tuning file %s: %d rows of other archs than %s skipped", path, foreign, arch)
        if dups:
            warnings.warn(f"hipkern tuning file {path} has {dups} rows whose key an earlier row has; kept the "
                          f"fastest of each key (then the newest)", stacklevel=4)
        # Later files win on the same key; a later row without a device (a file from before the column) stands
        # for every GPU, so it also replaces the earlier files' rows of its shape and CU count for any device.
        anyone = {k[:3] for k in mine if k[3] == ""}
        replaced = [k for k in self.exact if k in mine or k[:3] in anyone]
        if replaced:  # a user's row shadowing a shipped (or an earlier file's) row: say so, once a file
            k = replaced[0]
            log.info("hipkern: tuning file %s replaces %d %s row(s) of earlier files (the shipped ones first) on "
                     "%s, e.g. %s: %s -> %s", path, len(replaced), self.schema.op, arch, _key_text(self.schema, k),
                     _choice_text(self.exact[k]), _choice_text(mine.get(k) or mine[k[:3] + ("",)]))
        if anyone:
            self.exact = {k: r for k, r in self.exact.items() if k[:3] not in anyone}
        self.exact.update(mine)

    def _parse(self, raw: dict, arch: str):
        return parse_row(self.schema, raw, arch)

    def find(self, exact: tuple, buckets: tuple, cu_count: int, device: str = ""):
        for dev in dict.fromkeys((device, "")):
            row = self.exact.get((exact, buckets, cu_count, dev))
            if row is not None:
                return row, "exact"
        best, best_rank = None, None
        for r in self.groups.get(exact, ()):
            dist = sum(abs(math.log2(r[k]) - math.log2(b)) for k, b in zip(self.schema.bucket_keys, buckets))
            dist += 0.5 * (r["cu_count"] != cu_count) + 0.25 * (r[DEVICE] not in ("", device))
            rank = (dist, tuple(-r[k] for k in self.schema.bucket_keys), r[DEVICE] != device,
                    self.device_rank[r[DEVICE]], _date_rank(r.get("date") or ""), abs(r["cu_count"] - cu_count),
                    -r["cu_count"])  # (a total order: rows that tie so far differ in cu_count alone)
            if best_rank is None or rank < best_rank:
                best, best_rank = r, rank
        return (best, "nearest") if best is not None else (None, None)


def _key_text(schema: Schema, key: tuple) -> str:
    exact, buckets, cu, dev = key
    return ", ".join([*(f"{n}={v}" for n, v in zip(schema.exact_keys + schema.bucket_keys, exact + buckets)),
                      f"cu_count={cu}"] + ([f"device={dev}"] if dev else []))


def _choice_text(row: dict) -> str:
    return f"{row['variant']} ({float(row['us']):g} us, {row.get('date') or 'undated'})"


def _date_rank(d: str) -> tuple:
    return (d == "", tuple(-ord(c) for c in d))  # newer ISO dates first, undated rows last


def _table(op: str, arch: str) -> _Table:
    t = _tables.get((op, arch))
    if t is None:
        with _lock:
            t = _tables.get((op, arch))
            if t is None:
                t = _tables[(op, arch)] = _Table(_schemas[op], arch)
    return t


def lookup(op: str, arch: str, cu_count: int, *, device_name: str = "", **shape) -> Choice | None:
    """The tuned choice for `shape` (exact keys and bucket keys of the op's schema, buckets already
    bucketed) on a GPU of `arch`, `cu_count` and name `device_name` (torch.cuda.get_device_name; "":
    unknown, only rows without a device are exact), or None for the heuristic default. Memoised per shape."""
    memo_key = (op, arch, cu_count, device_name, *shape.items())  # names and raw values: a hit costs one dict get
    while True:
        hit = _memo.get(memo_key, _MISS)
        if hit is not _MISS:
            return hit
        gen = _generation[0]
        t = _table(op, arch)
        exact = tuple(str(shape[k]) for k in t.schema.exact_keys)
        buckets = tuple(int(shape[k]) for k in t.schema.bucket_keys)
        row, source = t.find(exact, buckets, cu_count, device_name.strip())
        choice = None if row is None else Choice(row["variant"], row["params"], source, row)
        with _lock:  # one thread stores (and logs) a shape's choice; one made before a reset() is not kept
            if gen != _generation[0]:
                continue
            first = memo_key not in _memo
            if first:
                _memo[memo_key] = choice
            choice = _memo[memo_key]
        if first and source != "exact":
            _log_untuned(t.schema, arch, cu_count, device_name, shape, choice)
        return choice


_memo: dict = {}
_MISS = object()


def _log_path(path: str, cols: list, op: str) -> str:
    """`path`, or beside it `<stem>.<op><ext>` where `path` already holds another op's columns (one
    process logs several ops; the tuner reads one op's columns a file)."""
    try:
        with open(path, newline="") as fh:
            head = fh.readline().rstrip("\r\n")
    except OSError:
        return path
    if not head or head == ",".join(cols):
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{op}{ext or '.csv'}"


def _log_untuned(schema: Schema, arch: str, cu_count: int, device_name: str, shape: dict, choice) -> None:
    how = (f"nearest tuned row ({choice.variant}, {choice.row[DEVICE] or 'any device'}, {choice.row.get('date', '')})"
           if choice else "heuristic default")
    log.info("hipkern: %s on %s has no tuned row for %s (GPU %s); using the %s", schema.op, arch, shape,
             device_name or "unnamed", how)
    path = os.environ.get("HIPKERN_LOG_UNTUNED")
    if not path:
        return
    cols = ["op", "arch", "cu_count", DEVICE, *schema.exact_keys, *schema.bucket_keys]
    with _lock:
        path = _log_path(path, cols, schema.op)
        try:
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as fh:
                w = csv.writer(fh, lineterminator="\n")
                if new:
                    w.writerow(cols)
                w.writerow([schema.op, arch, cu_count, device_name, *(shape[k] for k in schema.exact_keys),
                            *(shape[k] for k in schema.bucket_keys)])
            return
        except OSError as e:  # a diagnostics variable never fails the op
            if path in _log_failed:
                return
            _log_failed.add(path)
            why = e
    warnings.warn(f"hipkern: HIPKERN_LOG_UNTUNED file {path} cannot be written ({why}); untuned shapes are not "
                  f"logged there", stacklevel=3)


_log_failed: set = set()  # HIPKERN_LOG_UNTUNED paths that could not be written (warned once each)
