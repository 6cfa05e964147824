"""The run's metrics.jsonl on the coordinator, from the lines every machine relays.

Each machine's first worker writes its machine's metrics.jsonl (Runtime.writes_metrics) and its
agent relays the new lines (train/agent.py). The machines' step records differ (each holds its
own worker's training loss), and so do their round records' scalars (worker 0 averages over the
workers, the others log their own); their membership records say the same thing. So one
machine is the source: the one holding the lowest slot when the first lines come, and it stays
the source until it is lost (a joiner in a lower slot does not take over, so no record falls
between two sources). The others' lines are kept in reserve from the newest record written on;
when the source is lost, the machine holding the lowest slot among the rest takes over from
there. A source whose writing worker was restarted (it rejoins at a round end) has a gap, seen
as a jump in its step records: the records of the rounds trained meanwhile come from the
reserve. A round record that comes late (worker 0 writes it once the workers' means are in,
possibly after the next round's steps) is not a gap. A record without a step (membership) that
is already in the log is not written again.
Every round is logged once, in order, whatever machines come and go.

Every line is checked (`_parse_line`) before any is kept: a record of the wrong shape held in a
reserve would break the comparisons of every later call, whichever machine made it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from frugaltrain.metrics.log import keep_until_step

MAX_STEP = 2**63 - 1  # torch's int64: no run counts steps past it
MAX_DEPTH = 16  # nesting of a record's values; records are flat, and json recurses per level


class MetricsRelay:
    """Appends relayed lines to `path`; all its methods share one lock (each machine's channel
    is a thread of its own)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.source: str | None = None
        self.newest: dict[str, int] | None = None  # newest step per record kind written
        self.seen: set[str] = set()  # the records without a step written (their identity)
        self.reserve: dict[str, list[tuple[dict, str]]] = {}  # machine -> its unwritten lines

    def add(self, machine: str, lines: list[str], holders: list[str]) -> None:
        """`machine`'s new lines; `holders`: the machines holding slots, the lowest slot's
        first. A line that is not one record (`_parse_line`) raises ValueError naming the
        machine, and none of the call's lines is kept (the channel that sent them ends). A
        record already written (a machine whose acknowledgement was lost sends it again) is
        dropped."""
        if type(lines) is not list:
            raise ValueError(f"machine {machine}: metrics: a {type(lines).__name__}, not a list")
        try:
            parsed = [_parse_line(x) for x in lines]  # all checked before any is kept
        except ValueError as e:
            raise ValueError(f"machine {machine}: metrics: {e}") from None
        with self.lock:
            if self.newest is None:
                self.newest, self.seen = _written(self.path)
            self.reserve.setdefault(machine, []).extend(parsed)
            if self.source not in holders:
                self.source = holders[0] if holders else machine
            out: list[str] = []
            for rec, line in self.reserve.pop(self.source, []):
                if rec.get("kind") == "step" and rec["step"] > self.newest.get("step", 0) + 1:
                    out += self._fill(rec["step"], holders)  # the source's writer restarted
                out += self._take(rec, line)
            self._drop_written()
            if out:
                with open(self.path, "a") as f:
                    f.writelines(x.rstrip("\n") + "\n" for x in out)

    def cut(self, step: int) -> None:
        """Keep the records up to `step` (a resumed run logs the rounds after it again)."""
        with self.lock:
            keep_until_step(self.path, step)
            self.newest, self.reserve = None, {}

    def _take(self, rec: dict, line: str) -> list[str]:
        step = rec.get("step")
        if step is None:
            if _identity(rec) in self.seen:
                return []
            self.seen.add(_identity(rec))
            return [line]
        if step <= self.newest.get(rec.get("kind"), -1):
            return []
        self.newest[rec.get("kind")] = step
        return [line]

    def _fill(self, step: int, holders: list[str]) -> list[str]:
        """The reserves' records between the newest written and `step`, in their order, the
        lowest slot's machine first: a source whose writing worker was restarted has none of
        the rounds trained meanwhile."""
        out = []
        for machine in holders:
            started = False  # past the records already written (and the views of them)
            for rec, line in self.reserve.get(machine, []):
                s = rec.get("step")
                if s is not None and s >= step:
                    break
                started = started or (s is not None and s > self.newest.get(rec["kind"], -1))
                if started:
                    out += self._take(rec, line)
        return out

    def _drop_written(self) -> None:
        """Drop each reserve's lines up to its last record already written (the records without
        a step among them too: the source wrote its own view of those)."""
        for machine, lines in self.reserve.items():
            last = -1
            for i, (rec, _) in enumerate(lines):
                step = rec.get("step")
                if step is not None and step <= self.newest.get(rec.get("kind"), -1):
                    last = i
            self.reserve[machine] = lines[last + 1 :]


def _parse_line(line: object) -> tuple[dict, str]:
    """One relayed line as (its record, the line), or ValueError saying what is wrong: it must
    be a string of one line (the log is read back with splitlines) that can be written as
    UTF-8, holding a JSON object nested at most MAX_DEPTH deep, whose "step", if it has one, is
    an integer in [0, MAX_STEP] and whose "kind" is then a string."""
    if type(line) is not str:
        raise ValueError(f"a line is a {type(line).__name__}, not a string")
    text = line.rstrip("\n")
    if text.splitlines() != [text]:
        raise ValueError(f"a line that is not one line: {text[:80]!r}")
    try:
        text.encode()  # a lone surrogate (sent escaped in the frame) cannot be written
    except UnicodeEncodeError:
        raise ValueError(f"a line that is not UTF-8: {text[:80]!r}") from None
    try:
        rec = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"a line that is not JSON ({str(e)[:80] or type(e).__name__})") from None
    if type(rec) is not dict:
        raise ValueError(f"a line that is not a JSON object: {text[:80]!r}")
    if _depth(rec) > MAX_DEPTH:
        raise ValueError(f"a record nested more than {MAX_DEPTH} deep")
    step = rec.get("step")
    if step is not None and (type(step) is not int or not 0 <= step <= MAX_STEP):
        raise ValueError(f"a record whose step is not an integer in [0, {MAX_STEP}]: {text[:80]!r}")
    if step is not None and type(rec.get("kind")) is not str:
        raise ValueError(f"a record with a step and no string kind: {text[:80]!r}")
    return rec, line


def _depth(value: object) -> int:
    """How deep lists and objects nest in a JSON value (without recursing: it may be deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            todo += [(y, d + 1) for y in (x.values() if isinstance(x, dict) else x)]
    return deepest


def _identity(rec: dict) -> str:
    """A record without a step, as every machine writes it (the reason a change was found
    differs between the machines that found it)."""
    return json.dumps({k: v for k, v in rec.items() if k != "reason"}, sort_keys=True)


def _written(path: Path) -> tuple[dict[str, int], set[str]]:
    """The newest step of each kind of record in a metrics log, and its records without one."""
    newest: dict[str, int] = {}
    seen: set[str] = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = _parse_line(line)[0] if line.strip() else {}
            except ValueError:  # torn by a crash mid-write: every later ping would fail on it
                continue
            if rec.get("step") is not None:
                newest[rec["kind"]] = max(newest.get(rec["kind"], -1), rec["step"])
            elif rec:
                seen.add(_identity(rec))
    return newest, seen
