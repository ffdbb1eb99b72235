"""Read scalars back from TensorBoard event files (for tests, tables and figures)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series under ``logdir`` (searched recursively for event files), as ``tag -> [(step, value)]``.

    Later event files win for a repeated step, so a resumed run (a new file) reads as one series; TensorBoard's own
    readers keep each folder a run of its own.
    """
    files = sorted(Path(logdir).rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {logdir}")
    series: dict[str, dict[int, float]] = {}
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            bucket = series.setdefault(tag, {})
            for event in acc.Scalars(tag):
                bucket[event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in series.items()}
