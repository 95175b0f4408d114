"""Progress on stderr for long runs: a rich bar on a terminal, JSON lines for scripts, or only
failures and the summary."""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

__all__ = ["ProgressView", "StderrView", "fmt_eta"]


class StderrView:
    """What every long run prints on stderr: a rich bar (``bar``: a terminal), JSON lines
    (``json``), or nothing but notes, failures and the summary (``none``)."""

    def __init__(self, mode: str, quiet: bool):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "none"
        self.mode = mode
        self.quiet = quiet
        self.bar: Progress | None = None  # (rich, imported when a bar is shown)
        self.task: TaskID | None = None
        self.n = 0

    def _emit(self, obj: dict) -> None:
        sys.stderr.write(json.dumps(obj, ensure_ascii=False) + "\n")
        sys.stderr.flush()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def note(self, msg: str) -> None:
        if self.quiet:
            return
        if self.mode == "json":
            self._emit({"event": "note", "message": msg})
        elif self.bar is not None:
            self.bar.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, file=sys.stderr, flush=True)

    def error(self, msg: str) -> None:
        """A failure, in red on the bar; in JSON mode the event that carries it says it."""
        if self.mode == "json":
            return  # carried by the image event
        if self.bar is not None:
            from rich.text import Text

            self.bar.console.print(Text(msg, style="red"))  # a style= would colour the bar too
        else:
            print(msg, file=sys.stderr, flush=True)


class ProgressView(StderrView):
    """A caption run's progress: counts, images/s over the last images, ETA."""

    def __init__(self, mode: str, quiet: bool):
        super().__init__(mode, quiet)
        self.events: deque[tuple[float, int]] = deque(maxlen=32)  # (time, images processed)
        self.total = 0

    def start(self, job, fmt: str) -> None:
        self.total = len(job.items)
        if self.mode == "json":
            self._emit(
                {
                    "event": "start",
                    "total": self.total,
                    "todo": job.todo(),
                    "out": job.out,
                    "format": fmt,
                    "model": job.model_name,
                    "settings": job.digest,
                    "metadata": job.metadata_path,
                }
            )
        elif self.mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
            )

            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("captioning"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} img/s · ETA {task.fields[eta]} · {task.fields[counts]}"),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("caption", total=self.total, rate="-", eta="-", counts="")
        self.t0 = time.monotonic()

    def _rate(self) -> float | None:
        if len(self.events) < 2:
            return None
        (t0, n0), (t1, n1) = self.events[0], self.events[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def update(self, res, summary) -> None:
        self.n += 1
        if res.status != "skipped":
            self.events.append((time.monotonic(), summary.done + summary.failed))
        rate = self._rate()
        left = self.total - self.n
        eta = left / rate if rate else None
        rec = res.record
        if res.status == "failed" and rec is not None:
            self.error(f"failed: {rec.path}: {rec.error}")
        if self.mode == "json":
            ev = {
                "event": "image",
                "n": self.n,
                "total": self.total,
                "path": res.item.path,
                "status": res.status,
                "done": summary.done,
                "skipped": summary.skipped,
                "failed": summary.failed,
                "images_per_s": round(rate, 3) if rate else None,
                "eta_s": round(eta, 1) if eta is not None else None,
            }
            if res.reason:
                ev["reason"] = res.reason
            if rec is not None:
                ev["custom_id"] = rec.custom_id
                if rec.error:
                    ev["error"] = rec.error
                else:
                    st = rec.stats or {}
                    ev.update(predicted_n=st.get("predicted_n"), cached_n=st.get("cached_n"), ms=st.get("total_ms"))
            self._emit(ev)
        elif self.bar is not None:
            counts = f"done {summary.done} · skipped {summary.skipped} · failed {summary.failed}"
            assert self.task is not None  # added with the bar
            self.bar.update(
                self.task, completed=self.n, rate=f"{rate:.2f}" if rate else "-", eta=fmt_eta(eta), counts=counts
            )

    def finish(self, summary, job) -> None:
        self.stop()
        if self.mode == "json":
            self._emit({"event": "summary", **summary.to_dict()})
            return
        if self.quiet:
            return
        for line in summary.lines():
            print(line, file=sys.stderr)
        where = job.metadata_path or ("caption files beside the images" if job.fmt == "txt" else None)
        print(f"records: {job.out}" + (f" · captions: {where}" if where else ""), file=sys.stderr)


def fmt_eta(eta: float | None) -> str:
    if eta is None:
        return "-"
    eta = int(eta)
    return f"{eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}" if eta >= 3600 else f"{eta // 60}:{eta % 60:02d}"
