"""A run's live view without a new open port: the coordinator writes RUN_DIR/status.html (one
self-contained page: inline CSS, an inline SVG chart, no script, no fetch) and RUN_DIR/metrics.prom
(node_exporter's textfile-collector format) every STATUS_S, and `frugaltrain status RUN_DIR`
prints the same in a terminal.

    frugaltrain status runs/mach            # machines, slots, loss, bytes, the last events
    node_exporter --collector.textfile.directory=runs/mach   # or copy metrics.prom there

Everything comes from three files of the run directory, read as they are at that moment:
coordinator.json (the port and each slot's machine id: cluster/coordinator.py), coordinator.log
(its timestamped lines; a machine's name and address come from its `joined` line) and
metrics.jsonl (round records and `"kind": "membership"` records: train/round_log.py,
metrics/peers.py). Reading never raises on what it finds: a missing file is an empty one, and a
line that is not a JSON object (the last one torn by a write in progress) is skipped, as is a
value of the wrong type. The names and lines come from members (a machine picks its own name),
so the page escapes every one of them and the terminal shows only printable characters.

A local run's directory (no coordinator.json) shows too: its rounds and bytes, without slots.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from frugaltrain.config import ConfigError

STATE = "coordinator.json"  # coordinator.COORDINATOR_STATE (the coordinator imports this module)
LOG = "coordinator.log"
METRICS = "metrics.jsonl"
PAGE, PROM = "status.html", "metrics.prom"
STATUS_S = 5.0  # how often the coordinator writes them; the page reloads itself as often
TAIL_BYTES = 1 << 20  # coordinator.log is read from its last MiB: refusals can make it long
LAST_LINES = 15  # coordinator.log lines shown
LAST_CHANGES = 20  # membership records shown
# "HH:MM:SS machine NAME (PEER) joined: slots [0, 1], ...": the name may hold anything printable,
# the greedy NAME leaves the last "(PEER) joined" (the coordinator's own words) to the rest.
_JOINED = re.compile(r"^\S+ machine (.*) \(([^()]*)\) joined: slots \[([0-9, ]*)\]")
_OVER = re.compile(r"\S+ training is over")  # the coordinator's last line, whole


def snapshot(run_dir: str | Path) -> dict:
    """What the run directory says now (see the module docstring); never raises on content."""
    run = Path(run_dir)
    owners, port, bind = _read_state(run / STATE)
    lines = _tail(run / LOG)
    rounds, changes = _read_metrics(run / METRICS)
    sent, received = _bytes(rounds, "peer/bytes_sent"), _bytes(rounds, "peer/bytes_received")
    joined = _joined(lines)
    has_state = (run / STATE).is_file()
    slots = []
    for i in range(max(len(owners), len(sent))):
        owner = owners[i] if i < len(owners) else None
        name, peer = joined.get(i, (None, None)) if owner else (None, None)
        state = ("held" if owner else "free") if has_state else "local"
        slots.append({"slot": i, "state": state, "machine": owner, "name": name, "peer": peer})
        slots[-1].update(bytes_sent=_at(sent, i), bytes_received=_at(received, i))
    last = rounds[-1] if rounds else {}
    return {
        "run_dir": str(run),
        "name": run.resolve().name,
        "found": {f: (run / f).is_file() for f in (STATE, LOG, METRICS)},
        "port": port,
        "bind": bind,
        "slots": slots,
        "machines": _machines(slots),
        "rounds": rounds,
        "clock": last.get("clock"),
        "membership": changes[-LAST_CHANGES:],
        "membership_changes": len(changes),
        "log": lines[-LAST_LINES:],
        "over": any(_OVER.fullmatch(line) for line in lines),
        "updated": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _read_state(path: Path) -> tuple[list[str | None], int | None, str | None]:
    """coordinator.json's slot owners (machine ids), port and bind address."""
    try:
        state = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return [], None, None
    if not isinstance(state, dict):
        return [], None, None
    owners = state.get("slots") if isinstance(state.get("slots"), list) else []
    port = state.get("port") if type(state.get("port")) is int else None
    bind = state.get("bind") if isinstance(state.get("bind"), str) else None
    return [o if isinstance(o, str) and o else None for o in owners], port, bind


def _tail(path: Path, limit: int = TAIL_BYTES) -> list[str]:
    """The lines of a log's last `limit` bytes (the first one dropped when cut short)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            lines = f.read(limit).decode(errors="replace").splitlines()
    except OSError:
        return []
    return lines[1:] if size > limit else lines


def _read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """The round records (the figures shown, one per round: the last one logged of each) and
    the membership records of a metrics log."""
    try:
        lines = path.read_bytes().decode(errors="replace").splitlines()
    except OSError:
        return [], []
    rounds: dict[int, dict] = {}
    changes = []
    for line in lines:
        if '"kind": "step"' in line:  # most lines; not shown, so not parsed
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # a torn last line, or not JSON
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("kind") == "round" and _int(rec.get("round")) is not None:
            rounds[rec["round"]] = _round(rec)
        elif rec.get("kind") == "membership":
            changes.append(_change(rec))
    return [rounds[r] for r in sorted(rounds)], changes


def _round(rec: dict) -> dict:
    clock = rec.get("clock") if isinstance(rec.get("clock"), str) else None
    if clock and isinstance(rec.get("links"), str):  # paced links (comm/pacing.py)
        clock = f"{clock}, {rec['links']} links"
    workers = _int(rec.get("ft/members"))
    return {
        "round": rec["round"],
        "step": _int(rec.get("step")),
        "wall_s": _num(rec.get("time/wall_s")),
        "loss": _num(rec.get("loss/train")),
        "val": _num(rec.get("loss/val")),
        "workers": workers if workers is not None else _int(rec.get("workers")),
        "clock": clock,
        "peer/bytes_sent": _numbers(rec.get("peer/bytes_sent")),
        "peer/bytes_received": _numbers(rec.get("peer/bytes_received")),
    }


def _change(rec: dict) -> dict:
    """A membership record as shown: its round, event, members and the rest in one line."""
    members = rec.get("members")
    shown = {"kind", "event", "round", "epoch", "members"}
    detail = " ".join(f"{k}={json.dumps(v)}" for k, v in rec.items() if k not in shown)
    return {
        "round": _int(rec.get("round")),
        "event": str(rec.get("event"))[:40],
        "members": [m for m in members if _int(m) is not None] if isinstance(members, list) else [],
        "detail": detail[:200],
    }


def _int(value: object) -> int | None:
    return value if type(value) is int else None


def _num(value: object) -> float | None:
    """A finite number, else None (a bool, a string, NaN: not a figure)."""
    ok = type(value) in (int, float) and math.isfinite(value)
    return value if ok else None


def _numbers(value: object) -> list[float | None]:
    return [_num(v) for v in value] if isinstance(value, list) else []


def _at(values: list, i: int):
    return values[i] if i < len(values) else None


def _bytes(rounds: list[dict], key: str) -> list[int | None]:
    """Each worker's bytes summed over the rounds (None: it never counted any)."""
    total: list[float | None] = []
    for r in rounds:
        for i, v in enumerate(r[key]):
            total += [None] * (i + 1 - len(total))
            if v is not None:
                total[i] = (total[i] or 0) + v
    return [None if t is None else int(t) for t in total]


def _joined(lines: list[str]) -> dict[int, tuple[str, str]]:
    """slot -> (name, address) of the machine whose `joined` line named it last."""
    out = {}
    for line in lines:
        m = _JOINED.match(line)
        if m:
            for s in m.group(3).replace(" ", "").split(","):
                if s:
                    out[int(s)] = (m.group(1), m.group(2))
    return out


def _machines(slots: list[dict]) -> list[dict]:
    """The machines holding slots, the one with the lowest slot first, with their bytes."""
    out: dict[str, dict] = {}
    for s in slots:
        if s["machine"] is None:
            continue
        m = out.setdefault(
            s["machine"],
            {"id": s["machine"], "name": s["name"], "peer": s["peer"], "slots": []},
        )
        m["slots"].append(s["slot"])
        for key in ("bytes_sent", "bytes_received"):
            if s[key] is not None:
                m[key] = m.get(key, 0) + s[key]
    return list(out.values())


# ---- the page
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1100px}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .3em}
table{border-collapse:collapse}td,th{padding:.2em .8em;border-bottom:1px solid #ddd;
text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cap{color:#666;font-size:.9em;margin:.2em 0}.free{color:#999}
pre{background:#f6f6f6;padding:.6em;white-space:pre-wrap;font-size:12px}
svg text{font-size:11px;fill:#444}
"""


def render_html(snap: dict) -> str:
    """The page: self-contained, reloading itself every STATUS_S; every string from the run
    escaped."""
    e = _esc
    title = f"frugaltrain status: {e(snap['name'])}"
    body = [
        f"<h1>{title}</h1>",
        f'<p id="summary">{e(_headline(snap))}</p>',
        '<h2>Machines</h2><p class="cap">Machines holding slots now (coordinator.json), named '
        "as they joined (coordinator.log). Bytes: counted by each worker's comm (model-counted "
        "payload, measured run), summed over the rounds logged, for the slots held now.</p>",
        _members_table(snap),
        '<h2>Slots</h2><p class="cap">One slot per worker rank; a slot\'s bytes include those '
        "of the machines that held it before.</p>",
        _slots_table(snap),
        "<h2>Loss against wall clock</h2>",
        f'<p class="cap">{e(_chart_caption(snap))}</p>',
        _loss_svg(snap["rounds"]),
        "<h2>Membership timeline</h2>",
        f'<p class="cap">The workers\' membership records (metrics.jsonl): the last '
        f"{len(snap['membership'])} of {snap['membership_changes']}.</p>",
        _membership_table(snap),
        "<h2>Last events</h2>",
        f'<p class="cap">The last {len(snap["log"])} lines of coordinator.log (its local '
        "time).</p>",
        f'<pre id="log">{e(chr(10).join(snap["log"])) or "(no coordinator.log)"}</pre>',
        f'<p class="cap" id="updated">Read at {e(snap["updated"])} from {e(snap["run_dir"])}; '
        f"the coordinator rewrites this page every {STATUS_S:g} s.</p>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="refresh" content="{STATUS_S:g}">\n'
        f"<title>{title}</title>\n<style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _esc(value: object) -> str:
    return html.escape("" if value is None else str(value))


def _headline(snap: dict) -> str:
    """One line: where the run stands."""
    held = sum(s["state"] == "held" for s in snap["slots"])
    parts = ["training is over" if snap["over"] else "training"]
    if snap["found"][STATE]:
        parts.append(f"{len(snap['machines'])} machines, {held} of {len(snap['slots'])} slots held")
        if snap["port"] is not None:
            parts.append(f"coordinator on {snap['bind'] or '?'}:{snap['port']}")
    if snap["rounds"]:
        r = snap["rounds"][-1]
        parts.append(f"round {r['round']}, step {_show(r['step'])}")
        parts.append(f"train loss {_show(r['loss'], '.4f')}")
        vals = [x["val"] for x in snap["rounds"] if x["val"] is not None]
        if vals:
            parts.append(f"val loss {vals[-1]:.4f}")
        if r["wall_s"] is not None:
            parts.append(f"{r['wall_s']:.1f} s wall clock ({r['clock'] or 'clock not logged'})")
    else:
        parts.append("no round logged yet")
    return "; ".join(parts)


def _show(value: float | int | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _members_table(snap: dict) -> str:
    rows = [
        f"<tr><td>{_esc(m['name'] or '(name not in the log)')}</td><td>{_esc(m['id'])}</td>"
        f"<td>{_esc(m['peer'] or '-')}</td><td>{_esc(m['slots'])}</td>"
        f'<td class="n">{_size(m.get("bytes_sent"))}</td>'
        f'<td class="n">{_size(m.get("bytes_received"))}</td></tr>'
        for m in snap["machines"]
    ]
    if not rows:
        rows = ['<tr><td colspan="6">no machine holds a slot</td></tr>']
    head = "<th>machine</th><th>id</th><th>address</th><th>slots</th><th>sent</th><th>received</th>"
    return f'<table id="members"><tr>{head}</tr>\n' + "\n".join(rows) + "\n</table>"


def _slots_table(snap: dict) -> str:
    rows = [
        f'<tr class="{s["state"]}"><td>{s["slot"]}</td><td>{s["state"]}</td>'
        f"<td>{_esc(s['name'] or s['machine'] or '-')}</td>"
        f'<td class="n">{_size(s["bytes_sent"])}</td>'
        f'<td class="n">{_size(s["bytes_received"])}</td></tr>'
        for s in snap["slots"]
    ]
    head = "<th>slot</th><th>state</th><th>machine</th><th>sent</th><th>received</th>"
    return f'<table id="slots"><tr>{head}</tr>\n' + "\n".join(rows) + "\n</table>"


def _membership_table(snap: dict) -> str:
    rows = [
        f"<tr><td>{_show(c['round'])}</td><td>{_esc(c['event'])}</td>"
        f"<td>{_esc(c['members'])}</td><td>{_esc(c['detail'])}</td></tr>"
        for c in snap["membership"]
    ]
    if not rows:
        rows = ['<tr><td colspan="4">no membership change logged</td></tr>']
    head = "<th>round</th><th>event</th><th>members after</th><th>detail</th>"
    return f'<table id="membership"><tr>{head}</tr>\n' + "\n".join(rows) + "\n</table>"


def _chart_caption(snap: dict) -> str:
    return (
        "Blue: loss/train, the workers' mean training loss of each round; orange dots: loss/val "
        "where the round evaluated. x: time/wall_s, seconds since the logging worker started "
        f"training (clock: {snap['clock'] or 'not logged'})."
    )


def _loss_svg(rounds: list[dict], w: int = 720, h: int = 260) -> str:
    """Loss against wall-clock seconds: one polyline point per round with both figures."""
    train = [(r["wall_s"], r["loss"]) for r in rounds if None not in (r["wall_s"], r["loss"])]
    val = [(r["wall_s"], r["val"]) for r in rounds if None not in (r["wall_s"], r["val"])]
    if not train:
        return '<p id="loss">no round with a loss and a wall-clock time yet</p>'
    left, right, top, bottom = 60, 16, 12, 40
    xs, ys = [x for x, _ in train + val], [y for _, y in train + val]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def at(x: float, y: float) -> str:
        px = left + (x - x0) / (x1 - x0) * (w - left - right)
        py = h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg id="loss" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" role="img"><title>loss against wall-clock seconds</title>',
        f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" '
        'fill="#fafafa" stroke="#ccc"/>',
        f'<text x="{left - 6}" y="{top + 10}" text-anchor="end">{y1:.3g}</text>',
        f'<text x="{left - 6}" y="{h - bottom}" text-anchor="end">{y0:.3g}</text>',
        f'<text x="{left}" y="{h - bottom + 16}">{x0:.3g} s</text>',
        f'<text x="{w - right}" y="{h - bottom + 16}" text-anchor="end">{x1:.3g} s</text>',
        f'<text x="{(w + left) // 2}" y="{h - 6}" text-anchor="middle">wall clock, s</text>',
        f'<text x="14" y="{(h - bottom + top) // 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(h - bottom + top) // 2})">loss</text>',
        '<polyline class="train" fill="none" stroke="#1f6fb4" stroke-width="2" points="'
        + " ".join(at(x, y) for x, y in train)
        + '"/>',
    ]
    if val:
        parts.append(
            '<polyline class="val" fill="none" stroke="#d9731a" stroke-width="2" '
            'stroke-dasharray="6 4" points="' + " ".join(at(x, y) for x, y in val) + '"/>'
        )
        for x, y in val:  # evaluations are sparse: a dot each, seen even when alone
            cx, cy = at(x, y).split(",")
            parts.append(f'<circle class="val" cx="{cx}" cy="{cy}" r="3" fill="#d9731a"/>')
    return "\n".join(parts) + "\n</svg>"


# ---- the Prometheus textfile
def render_prom(snap: dict) -> str:
    """node_exporter's textfile format: `# HELP`, `# TYPE`, then `name{labels} value` lines;
    a figure the run has not logged is left out, not written as zero."""
    out = []
    for name, kind, help_, samples in _prom_metrics(snap):
        samples = [(labels, v) for labels, v in samples if v is not None]
        if samples:
            out += [f"# HELP frugaltrain_{name} {help_}", f"# TYPE frugaltrain_{name} {kind}"]
            out += [f"frugaltrain_{name}{_labels(labels)} {_value(v)}" for labels, v in samples]
    return "\n".join(out) + "\n"


def _prom_metrics(snap: dict) -> list[tuple[str, str, str, list[tuple[dict, float | None]]]]:
    """(name, type, help, [(labels, value)]) of every metric; a None value is not logged."""
    rounds, slots = snap["rounds"], snap["slots"]
    last = rounds[-1] if rounds else {}
    vals = [r["val"] for r in rounds if r["val"] is not None]
    val = vals[-1] if vals else None
    held = sum(s["state"] == "held" for s in slots)

    def one(value: float | None) -> list[tuple[dict, float | None]]:
        return [({}, value)]

    found = [
        ("round", "gauge", "The last round logged.", one(last.get("round"))),
        ("step", "gauge", "The inner step of the last round logged.", one(last.get("step"))),
        ("loss", "gauge", "loss/train of the last round (workers' mean).", one(last.get("loss"))),
        ("val_loss", "gauge", "loss/val of the last round that evaluated.", one(val)),
        ("wall_seconds", "gauge", "Last round's time/wall_s, measured.", one(last.get("wall_s"))),
        ("workers", "gauge", "Workers training in the last round.", one(last.get("workers"))),
    ]
    if snap["found"][STATE]:  # a coordinator's run
        owners = [
            ({"worker": str(s["slot"]), "machine": s["name"] or "", "id": s["machine"]}, 1)
            for s in slots
            if s["machine"]
        ]
        by_state = [({"state": "held"}, held), ({"state": "free"}, len(slots) - held)]
        found += [
            ("members", "gauge", "Machines holding slots.", one(len(snap["machines"]))),
            ("slots", "gauge", "Slots by state.", by_state),
            ("slot_machine", "gauge", "The machine holding each slot (always 1).", owners),
        ]
    for key in ("sent", "received"):
        what = f"Bytes each worker {key}: model-counted by its comm, summed over the rounds logged."
        by_worker = [({"worker": str(s["slot"])}, s[f"bytes_{key}"]) for s in slots]
        found.append((f"bytes_{key}_total", "counter", what, by_worker))
    changes, over = snap["membership_changes"], int(snap["over"])
    found += [
        ("membership_changes_total", "counter", "Membership records logged.", one(changes)),
        ("training_over", "gauge", "1 once the coordinator has logged the end.", one(over)),
    ]
    return found


def _value(v: float) -> str:
    """A sample's value: an integer in full (a byte counter past 1e6 keeps its digits)."""
    return str(v) if isinstance(v, int) else repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    """`{k="v",...}`, each value escaped as the exposition format asks: \\ " and newline."""
    if not labels:
        return ""
    esc = {
        k: v.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
        for k, v in labels.items()
    }
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


# ---- the terminal
def render_text(snap: dict) -> str:
    """The page's content as plain lines for a terminal (only printable characters)."""
    out = [f"{snap['name']} ({snap['run_dir']}): {_headline(snap)}"]
    if snap["slots"]:
        out.append("slots:")
    for s in snap["slots"]:
        who = f"{s['name'] or '?'} ({s['machine']}, {s['peer'] or '?'})" if s["machine"] else "-"
        out.append(
            f"  {s['slot']:>3} {s['state']:<5} {who}  sent {_size(s['bytes_sent'])}, "
            f"received {_size(s['bytes_received'])}"
        )
    if snap["slots"]:
        out.append("  (bytes: model-counted by each worker's comm, summed over the rounds logged)")
    if snap["rounds"]:
        out.append(f"loss/train by round (clock: {snap['clock'] or 'not logged'}):")
        for r in snap["rounds"][-10:]:
            val = f", val {r['val']:.4f}" if r["val"] is not None else ""
            wall = f"{r['wall_s']:9.1f} s" if r["wall_s"] is not None else "        - s"
            out.append(f"  round {r['round']:>5}  {wall}  loss {_show(r['loss'], '.4f')}{val}")
    out.append(f"membership changes: {snap['membership_changes']}")
    for c in snap["membership"][-5:]:
        out.append(f"  round {_show(c['round'])}: {c['event']} -> {c['members']} {c['detail']}")
    if snap["log"]:
        out.append("coordinator.log:")
        out += [f"  {line}" for line in snap["log"]]
    return "\n".join("".join(c if c.isprintable() else "?" for c in line) for line in out)


def status_text(run_dir: str | Path) -> str:
    """`frugaltrain status RUN_DIR`: the terminal view; ConfigError when RUN_DIR is no run's."""
    run = Path(run_dir)
    if not (run / STATE).is_file() and not (run / METRICS).is_file():
        raise ConfigError(
            f"{run_dir}: no {STATE} or {METRICS} there; pass a run directory (the coordinator "
            "prints its own when it starts)"
        )
    return render_text(snapshot(run))


# ---- the files
def write(run_dir: str | Path) -> None:
    """Write status.html and metrics.prom into `run_dir`, each whole: a temporary file beside
    it (a name node_exporter's collector skips: not *.prom), then renamed over it. OSError
    when the directory cannot be written."""
    run = Path(run_dir)
    snap = snapshot(run)
    for name, text in ((PAGE, render_html(snap)), (PROM, render_prom(snap))):
        tmp = run / f".{name}.{os.getpid()}.tmp"
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, run / name)
        finally:
            tmp.unlink(missing_ok=True)


class StatusWriter:
    """`write` every STATUS_S on a daemon thread, from `start` until `stop`, which writes the
    last one (the end in it) and returns once it is written. A failed write is said once per
    distinct error (`say`: the coordinator's log) and tried again next time; it never stops
    the run."""

    def __init__(self, run_dir: Path, say: Callable[[str], None], every_s: float = STATUS_S):
        self.run_dir, self.say, self.every_s = run_dir, say, every_s
        self.stopping = threading.Event()
        self.failed = ""
        self.thread = threading.Thread(target=self._run, daemon=True, name="status")

    def start(self) -> StatusWriter:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread after its last write; again later: one more write (the end)."""
        if self.stopping.is_set():
            self.write()
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()

    def write(self) -> None:
        try:
            write(self.run_dir)
        except OSError as e:
            if str(e) != self.failed:
                self.failed = str(e)
                self.say(f"could not write {PAGE} and {PROM}: {e}")

    def _run(self) -> None:
        while True:
            last = self.stopping.is_set()
            self.write()
            if last:
                return
            self.stopping.wait(self.every_s)
