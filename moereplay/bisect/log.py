"""The session log: one JSON document per line, appended as the session goes, kept in the state directory.

Where (:func:`default_log_path`): ``$MOEREPLAY_STATE_DIR/bisect/`` when that is set, else
``./moereplay-captures/bisect/`` — the default capture directory, relative to the working directory — never beside
the capture (a bundled or shared capture's folder is not the user's to write in). The name is the capture's file name,
eight hex digits of its resolved path (two captures of one name do not share a log), the strategy and its tag.

Records, in order::

    {"record": "session", "format": 1, "strategy": …, "config": {…}, "capture": …, "started": …}
    {"record": "step", "number": 1, "probe": {"key": …, "label": …}, "observation": {…},
     "decided_by": "auto" | "person", "auto_observation": {…} | null, "seconds": …, "time": …}
    …
    {"record": "summary", "summary": {…}, "time": …}

Each line is flushed as it is written, so a session killed mid-way leaves every decided step on disk; a last line
cut off by the kill is dropped (and trimmed away when the session resumes). The log is plain data: reading it never
evaluates anything, and its size is bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moereplay.bisect.errors import BisectLogError
from moereplay.bisect.observation import Decider, Observation

LOG_FORMAT = 1
MAX_LOG_BYTES = 64 * 1024 * 1024
"""A session log larger than this is refused: even a 10,000-call stream needs a few hundred steps at most."""


STATE_VARIABLE = "MOEREPLAY_STATE_DIR"
"""The environment variable naming the directory moereplay keeps its state in (bisect logs under ``bisect/``)."""


def state_directory(environ: Mapping[str, str] | None = None) -> Path:
    """``$MOEREPLAY_STATE_DIR``, else ``moereplay-captures`` in the working directory (read at call time)."""
    chosen = (os.environ if environ is None else environ).get(STATE_VARIABLE, "").strip()
    return Path(chosen).expanduser() if chosen else Path("moereplay-captures")


def default_log_path(
    capture: Path, strategy: str, tag: str | None = None, environ: Mapping[str, str] | None = None
) -> Path:
    """``<state>/bisect/<capture name>-<8 hex>.bisect-<strategy>[-<tag>].jsonl`` (``tag`` e.g. ``call12``)."""
    suffix = f"-{tag}" if tag else ""
    name = f"{capture_key(capture)}.bisect-{strategy}{suffix}.jsonl"
    return state_directory(environ) / "bisect" / name


def capture_key(capture: Path) -> str:
    """``<capture name>-<8 hex of its resolved path>``: names state about one capture (two captures of one name
    in different folders do not share it)."""
    where = hashlib.sha256(str(Path(capture).resolve()).encode()).hexdigest()[:8]
    return f"{Path(capture).name}-{where}"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Step:
    """One decided step of a session.

    ``probe_key`` is the probe's key as JSON data. ``auto_observation`` is what the predicate said when a person
    overrode it (``None`` otherwise, or when the person decided without running it). ``seconds`` is the predicate's
    wall time (``None`` for a person's decision made without a run).
    """

    number: int
    probe_key: Any
    label: str
    observation: Observation
    decided_by: Decider
    auto_observation: Observation | None = None
    seconds: float | None = None
    time: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "record": "step",
            "number": self.number,
            "probe": {"key": self.probe_key, "label": self.label},
            "observation": self.observation.to_json(),
            "decided_by": self.decided_by.value,
            "auto_observation": None if self.auto_observation is None else self.auto_observation.to_json(),
            "seconds": self.seconds,
            "time": self.time,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Step:
        probe = data.get("probe")
        number = data.get("number")
        if not isinstance(probe, Mapping) or "key" not in probe or not isinstance(probe.get("label"), str):
            raise BisectLogError(f"malformed probe in step {number!r}")
        if not isinstance(number, int) or isinstance(number, bool):
            raise BisectLogError(f"malformed step number {number!r}")
        try:
            decided_by = Decider(data.get("decided_by"))
        except ValueError as error:
            raise BisectLogError(f"step {number}: unknown decider {data.get('decided_by')!r}") from error
        raw_auto = data.get("auto_observation")
        seconds = data.get("seconds")
        if seconds is not None and not isinstance(seconds, (int, float)):
            raise BisectLogError(f"step {number}: malformed seconds {seconds!r}")
        time = data.get("time", "")
        return cls(
            number,
            probe["key"],
            probe["label"],
            Observation.from_json(data.get("observation")),
            decided_by,
            None if raw_auto is None else Observation.from_json(raw_auto),
            None if seconds is None else float(seconds),
            time if isinstance(time, str) else "",
        )


@dataclass(frozen=True)
class LoggedSession:
    """A session log as read back: its header, its steps, its summary if it finished."""

    path: Path
    header: Mapping[str, Any]
    steps: tuple[Step, ...]
    summary: Mapping[str, Any] | None
    complete_bytes: int  # length of the log up to its last whole line
    dropped_partial_line: bool

    @property
    def strategy(self) -> str:
        return str(self.header.get("strategy"))

    @property
    def config(self) -> Mapping[str, Any]:
        config = self.header.get("config")
        return config if isinstance(config, Mapping) else {}


def read_log(path: Path) -> LoggedSession:
    """Read a session log; a malformed record raises :class:`BisectLogError` naming the file and line."""
    try:
        size = path.stat().st_size
        if size > MAX_LOG_BYTES:
            raise BisectLogError(
                f"{path}: session log of {size} bytes exceeds the {MAX_LOG_BYTES}-byte limit"
            )
        raw = path.read_bytes()
    except OSError as error:
        raise BisectLogError(f"{path}: cannot read session log: {error.strerror or error}") from error
    complete = raw.rfind(b"\n") + 1
    dropped = complete < len(raw)
    header: Mapping[str, Any] | None = None
    steps: list[Step] = []
    summary: Mapping[str, Any] | None = None
    for number, line in enumerate(raw[:complete].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError) as error:
            raise BisectLogError(f"{path}:{number}: not a JSON line") from error
        if not isinstance(record, dict):
            raise BisectLogError(f"{path}:{number}: a record must be a JSON object")
        kind = record.get("record")
        try:
            if kind == "session":
                if header is not None:
                    raise BisectLogError("a second session header")
                if record.get("format") != LOG_FORMAT:
                    raise BisectLogError(f"unsupported log format {record.get('format')!r}")
                header = record
            elif header is None:
                raise BisectLogError("the first record must be the session header")
            elif summary is not None:
                raise BisectLogError("records after the summary")
            elif kind == "step":
                step = Step.from_json(record)
                if step.number != len(steps) + 1:
                    raise BisectLogError(f"step {step.number} where step {len(steps) + 1} was expected")
                steps.append(step)
            elif kind == "summary":
                content = record.get("summary")
                summary = content if isinstance(content, dict) else {}
            else:
                raise BisectLogError(f"unknown record {kind!r}")
        except BisectLogError as error:
            raise BisectLogError(f"{path}:{number}: {error}") from error
    if header is None:
        raise BisectLogError(f"{path}: no session header (empty log?)")
    return LoggedSession(path, header, tuple(steps), summary, complete, dropped)


class LogWriter:
    """Appends records to a session log, one flushed line each."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(
        cls, path: Path, strategy: str, config: Mapping[str, Any], *, capture: str | None, overwrite: bool
    ) -> LogWriter:
        """Start a new log with its header; refuses to replace an existing log unless ``overwrite``."""
        if path.exists() and not overwrite:
            raise BisectLogError(
                f"{path}: a session log already exists (resume it, or start afresh explicitly)"
            )
        header = {
            "record": "session",
            "format": LOG_FORMAT,
            "strategy": strategy,
            "config": dict(config),
            "capture": capture,
            "started": now(),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(header) + "\n", encoding="utf-8")
        except OSError as error:
            raise BisectLogError(f"{path}: cannot write session log: {error.strerror or error}") from error
        return cls(path)

    @classmethod
    def reopen(cls, logged: LoggedSession) -> LogWriter:
        """Continue a log read by :func:`read_log`, trimming a cut-off last line first."""
        if logged.dropped_partial_line:
            try:
                os.truncate(logged.path, logged.complete_bytes)
            except OSError as error:
                raise BisectLogError(f"{logged.path}: cannot trim the cut-off last line: {error}") from error
        return cls(logged.path)

    def append(self, record: Mapping[str, Any]) -> None:
        try:
            with self.path.open("a", encoding="utf-8") as stream:
                stream.write(json.dumps(record) + "\n")
                stream.flush()
        except OSError as error:
            raise BisectLogError(
                f"{self.path}: cannot append to session log: {error.strerror or error}"
            ) from error

    def append_step(self, step: Step) -> None:
        self.append(step.to_json())

    def append_summary(self, summary: Mapping[str, Any]) -> None:
        self.append({"record": "summary", "summary": dict(summary), "time": now()})
