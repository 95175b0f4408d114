"""OpenAI batch files: input lines read and checked, output lines shaped, and the output file
kept resumable (``edgevlm batch REQUESTS.jsonl --out RESULTS.jsonl``).

Input: one JSON object per line, ``{"custom_id", "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`` (the format OpenAI's Batch API and vLLM's ``run-batch`` read). Output: one line
per ``custom_id``, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``, in the order answers finish. A body the API refuses (a bad field, an image that does
not decode, a conversation too long) is a line with its 4xx ``status_code`` and OpenAI's error
body, exactly as ``edgevlm serve`` answers; a line that is not a request at all (not JSON, no
``custom_id``, another ``url``) is a line with ``response: null`` and ``error: {code, message}``.

Every output line is appended and fsync-ed as its answer finishes, under a lock (the caption
log's code), so a kill loses only the requests in flight. A rerun skips every ``custom_id``
already answered, and answers again those whose earlier answer was a server error (5xx: memory
short, a timeout), which may work now. A ``custom_id`` that appears twice is answered once; the
other lines are reported and leave the exit code at 4.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InputError, OutputError, shown
from ..jobs.records import BATCH_LINES, Entry, RecordLog

__all__ = [
    "BATCH_URLS",
    "BatchFile",
    "BatchLine",
    "BatchSummary",
    "BatchOutput",
    "error_line",
    "read_batch_file",
    "response_line",
]

BATCH_URLS = ("/v1/chat/completions", "/chat/completions", "/v1/responses", "/responses")
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 4, 130


@dataclass(frozen=True)
class BatchLine:
    """One input line: a request (``body`` set) or why it is not one (``code``/``message``)."""

    number: int  # 1-based
    custom_id: str | None
    body: dict[str, Any] | None = None
    code: str | None = None
    message: str | None = None
    url: str = "/v1/chat/completions"  # or /v1/responses: which API the body is for

    @property
    def responses(self) -> bool:
        return self.url.endswith("/responses")

    @property
    def ok(self) -> bool:
        return self.code is None

    @property
    def key(self) -> str:
        """What marks it done in the output: its custom_id, or (no usable one) its error."""
        return self.custom_id if self.custom_id is not None else f"\0{self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"custom_id": self.custom_id, "body": self.body, "number": self.number}


@dataclass
class BatchFile:
    path: str
    lines: list[BatchLine]
    duplicates: list[BatchLine] = field(default_factory=list)  # a custom_id seen on an earlier line


def _line(number: int, raw: str) -> BatchLine:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return BatchLine(number, None, code="invalid_json_line", message=f"line {number}: not JSON ({exc})")
    except RecursionError:  # (a poison line: every resume would die on it)
        return BatchLine(number, None, code="invalid_json_line", message=f"line {number}: nests too deeply")
    if not isinstance(obj, dict):
        return BatchLine(
            number,
            None,
            code="invalid_request",
            message=f"line {number}: a request is a JSON object, not {type(obj).__name__}",
        )
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(
            number, None, code="missing_custom_id", message=f"line {number}: custom_id must be a non-empty string"
        )
    method = obj.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        return BatchLine(
            number,
            cid,
            code="invalid_method",
            message=f"line {number}: method {shown(method)} is not supported (POST is)",
        )
    url = obj.get("url")
    if url not in BATCH_URLS:
        return BatchLine(
            number,
            cid,
            code="invalid_url",
            message=f"line {number}: url {shown(url)} is not supported (/v1/chat/completions and /v1/responses are)",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(number, cid, code="invalid_request", message=f"line {number}: body must be an object")
    return BatchLine(number, cid, body, url=url)


def read_batch_file(path: str) -> BatchFile:
    """Read and check the input; an unusable file (unreadable, not text, no request line at
    all) raises ``InputError`` naming it."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a batch file (not UTF-8 text)") from None
    out = BatchFile(path, [])
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        line = _line(number, raw)
        if line.custom_id is not None and line.custom_id in seen:
            out.duplicates.append(line)
            continue
        if line.custom_id is not None:
            seen.add(line.custom_id)
        out.lines.append(line)
    if not out.lines:
        raise InputError(f"{path}: holds no request lines")
    if not any(ln.ok or ln.custom_id is not None for ln in out.lines):
        raise InputError(
            f"{path}: not a batch file (no line is a JSON request with a custom_id; {out.lines[0].message})"
        )
    return out


# --- output lines ------------------------------------------------------------------------------


def response_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "batch_req_" + uuid.uuid4().hex[:24],
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": "req_" + uuid.uuid4().hex[:24], "body": body},
        "error": None,
    }


def error_line(line: BatchLine) -> dict[str, Any]:
    return {
        "id": "batch_req_" + uuid.uuid4().hex[:24],
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": line.code, "message": line.message},
    }


def _key(d: dict[str, Any]) -> str:
    cid: str | None = d.get("custom_id")  # (an output line: written by Output.write from a BatchLine)
    if cid is not None:
        return cid
    err = d.get("error") or {}
    return f"\0{err.get('message')}"


def _status(d: dict[str, Any]) -> int | None:
    resp = d.get("response")
    return resp.get("status_code") if isinstance(resp, dict) else None


@dataclass
class BatchSummary:
    total: int = 0  # request lines in the file (duplicates not counted)
    answered: int = 0  # status 200 now
    failed: int = 0  # error lines written now (4xx, 5xx, not a request)
    skipped: int = 0  # answered by an earlier run
    failed_before: int = 0  # ... of which with an error
    retried: int = 0  # 5xx answers of earlier runs, asked again
    duplicates: int = 0  # lines whose custom_id came earlier (not answered)
    interrupted: bool = False
    elapsed_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    out: str = ""

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.answered - self.failed - self.skipped)

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAILED if (self.failed or self.failed_before or self.duplicates) else EXIT_OK

    @property
    def requests_per_s(self) -> float:
        n = self.answered + self.failed
        return round(n / self.elapsed_s, 3) if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            remaining=self.remaining,
            exit_code=self.exit_code,
            requests_per_s=self.requests_per_s,
            elapsed_s=round(self.elapsed_s, 3),
        )
        return d

    def lines(self) -> list[str]:
        skipped = f"skipped {self.skipped}" + (f" ({self.failed_before} failed earlier)" if self.failed_before else "")
        head = (
            f"answered {self.answered} · {skipped} · failed {self.failed} · {self.total} request(s) "
            f"in {self.elapsed_s:.1f} s"
        )
        if self.answered:
            tps = self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
            head += f" · {self.requests_per_s:.2f} requests/s · {tps:.1f} tok/s"
        out = [head]
        if self.retried:
            out.append(f"asked again {self.retried} request(s) that got a server error earlier")
        if self.duplicates:
            out.append(f"{self.duplicates} line(s) repeat an earlier custom_id: not answered")
        if self.interrupted:
            out.append(f"interrupted: {self.remaining} request(s) left; run the same command again to continue")
        if self.failed or self.failed_before:
            out.append(
                f"{self.failed + self.failed_before} request(s) without an answer: their lines in "
                f'{self.out} have a 4xx/5xx status_code or "error" set'
            )
        return out


class BatchOutput:
    """The output file: locked, read for resume, appended line by line (fsync-ed)."""

    def __init__(self, batch: BatchFile, out: str):
        self.batch = batch
        self.out = out
        self.log = RecordLog(out, BATCH_LINES)
        self.summary = BatchSummary(total=len(batch.lines), duplicates=len(batch.duplicates), out=out)
        self.done: dict[str, dict[str, Any]] = {}
        self.t0 = time.perf_counter()

    def open(self) -> BatchOutput:
        self.log.open()
        drop: list[Entry] = []
        for e in self.log.entries:
            if not e.data:
                continue
            status = _status(e.data)
            if status is not None and status >= 500:
                drop.append(e)
                continue
            self.done[_key(e.data)] = e.data
        try:
            if drop:
                self.summary.retried = self.log.remove(drop)
        except OSError as exc:
            raise OutputError(f"{self.out}: cannot update ({exc.strerror or exc})") from None
        for line in self.batch.lines:
            prev = self.done.get(line.key)
            if prev is not None:
                self.summary.skipped += 1
                if prev.get("error") or (_status(prev) or 200) >= 400:
                    self.summary.failed_before += 1
        self.t0 = time.perf_counter()
        return self

    def todo(self) -> list[BatchLine]:
        return [ln for ln in self.batch.lines if ln.key not in self.done]

    def write(self, d: dict[str, Any]) -> bool:
        """Append one output line (False: its custom_id is answered already, nothing written)."""
        key = _key(d)
        if key in self.done:
            return False
        try:
            self.log.append(d)
        except OSError as exc:
            raise OutputError(f"{self.out}: cannot write ({exc.strerror or exc})") from None
        self.done[key] = d
        s = self.summary
        status = _status(d)
        if status == 200:
            s.answered += 1
            usage = d["response"]["body"].get("usage") or {}
            s.prompt_tokens += usage.get("prompt_tokens", 0)
            s.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            s.completion_tokens += usage.get("completion_tokens", 0)
        else:
            s.failed += 1
        s.elapsed_s = time.perf_counter() - self.t0
        return True

    def close(self) -> None:
        self.summary.elapsed_s = time.perf_counter() - self.t0
        self.log.close()

    def __enter__(self) -> BatchOutput:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()
