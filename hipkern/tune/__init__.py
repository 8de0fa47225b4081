"""The tuner: times every candidate (variant x parameters) of an op per shape and writes the tuning
database rows that hipkern.tuning_db reads.

    python -m hipkern.tune paged_attention                     # tuning/shapes/paged_attention.csv
    python -m hipkern.tune paged_attention --skip-done --time-limit 500    # resumable chunks
    python -m hipkern.tune paged_attention --gpus 0,1          # one worker process per GPU
    python -m hipkern.tune paged_attention --dry-run --arch sm_90 --cu-count 132   # plan and estimate
    python -m hipkern.tune report paged_attention              # chosen vs default, per shape

core: candidates, measuring, rows and merging; runner: running (here or in workers), progress,
crash retries; report: the report table; paged_attention: that op's adapter.
"""
from .core import Candidate, Pruned, load_adapter, read_shapes
from .report import report
from .runner import Summary, tune

__all__ = ["Candidate", "Pruned", "Summary", "load_adapter", "read_shapes", "report", "tune"]
