"""A run's live view (cluster/status.py): the snapshot of a coordinator's run directory, the page,
the Prometheus textfile, the terminal view and the files written whole; the page loaded in a real
headless Chromium where one is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from frugaltrain import cli
from frugaltrain.cluster import status
from frugaltrain.cluster.coordinator import COORDINATOR_STATE

HOSTILE = "<script>alert(1)</script>"  # a member picks its machine's name
SPOOF = "x (9.9.9.9:9) joined: slots [0]"  # a name that reads like the coordinator's words
SENT = [[100, 200, 300, None], [100, 200, 300, None], [1000, None, 300, None]]
LOSS, WALL = [5.0, 4.0, 3.5], [1.5, 3.0, 4.5]


def _rounds() -> list[dict]:
    return [
        {
            "kind": "round",
            "round": r + 1,
            "step": 4 * (r + 1),
            "clock": "measured",
            "workers": 3,
            "ft/members": 3 if r < 2 else 2,
            "time/wall_s": WALL[r],
            "loss/train": LOSS[r],
            "peer/bytes_sent": SENT[r],
            "peer/bytes_received": SENT[r],
            **({"loss/val": 3.25} if r == 2 else {}),
        }
        for r in range(3)
    ]


@pytest.fixture
def run_dir(tmp_path):
    """A coordinator's run directory: four slots, three held (one by a machine with a hostile
    name, one by a machine whose name imitates a join line), three rounds, a membership change,
    step records, a line that is not an object and a torn last line."""
    run = tmp_path / "mach"
    run.mkdir()
    state = {"port": 29400, "bind": "0.0.0.0", "slots": ["aaaa", "bbbb", "cccc", None]}
    (run / COORDINATOR_STATE).write_text(json.dumps(state) + "\n")
    (run / "coordinator.log").write_text(
        "10:00:00 run mach: diloco, 4 slots\n"
        "10:00:01 machine alpha (10.0.0.1:5000) joined: slots [0]\n"
        f"10:00:02 machine {HOSTILE} (10.0.0.2:5000) joined: slots [1, 3]\n"
        f"10:00:03 machine {SPOOF} (10.0.0.3:5000) joined: slots [2], its workers still running\n"
        "10:00:09 machine delta lost (silent): slots [3] are free\n"
    )
    records = [{"kind": "step", "step": s, "loss/train": 9.0, "lr": 0.1} for s in range(1, 13)]
    records += _rounds()
    records.insert(-1, {"kind": "membership", "event": "left", "round": 2, "epoch": 1,
                        "members": [0, 1, 2], "workers": [3], "reason": "gone"})  # fmt: skip
    lines = [json.dumps(r) for r in records] + ["[1, 2]", '{"kind": "round", "round": 4, "loss']
    (run / "metrics.jsonl").write_text("\n".join(lines))  # no newline: torn mid-write
    return run


def test_the_snapshot_reads_slots_rounds_bytes_and_events(run_dir):
    snap = status.snapshot(run_dir)
    assert [r["round"] for r in snap["rounds"]] == [1, 2, 3]  # the torn round 4 is skipped
    assert [r["loss"] for r in snap["rounds"]] == LOSS
    assert [r["wall_s"] for r in snap["rounds"]] == WALL
    assert snap["rounds"][-1]["workers"] == 2 and snap["rounds"][-1]["val"] == 3.25
    assert snap["clock"] == "measured" and snap["port"] == 29400 and not snap["over"]
    assert [s["state"] for s in snap["slots"]] == ["held", "held", "held", "free"]
    assert [s["name"] for s in snap["slots"]] == ["alpha", HOSTILE, SPOOF, None]
    assert [s["peer"] for s in snap["slots"]][:3] == [f"10.0.0.{i}:5000" for i in (1, 2, 3)]
    assert [s["bytes_sent"] for s in snap["slots"]] == [1200, 400, 900, None]
    assert [(m["id"], m["slots"]) for m in snap["machines"]] == [
        ("aaaa", [0]),
        ("bbbb", [1]),
        ("cccc", [2]),
    ]
    assert snap["machines"][0]["bytes_received"] == 1200
    (change,) = snap["membership"]
    assert change["event"] == "left" and change["members"] == [0, 1, 2] and change["round"] == 2
    assert snap["membership_changes"] == 1 and len(snap["log"]) == 5


def test_the_end_is_seen_in_the_log_and_a_long_log_is_read_from_its_tail(run_dir):
    with open(run_dir / "coordinator.log", "a") as f:
        f.write("10:00:10 machine training is over (10.0.0.9:1) sent a bad frame\n")
    assert not status.snapshot(run_dir)["over"]  # only the coordinator's own line, whole
    with open(run_dir / "coordinator.log", "a") as f:
        f.write("10:00:11 training is over\n")
    assert status.snapshot(run_dir)["over"]
    assert status._tail(run_dir / "coordinator.log", 30) == ["10:00:11 training is over"]


BAD = [
    "not json",
    "null",
    '"a string"',
    '{"kind": "round", "round": "7", "loss/train": 1.0}',
    '{"kind": "round", "round": true}',
    '{"kind": "round", "round": 1, "loss/train": "1.0", "time/wall_s": NaN, "step": 1.5}',
    '{"kind": "round", "round": 2, "loss/train": Infinity, "peer/bytes_sent": "abc"}',
    '{"kind": "round", "round": 3, "peer/bytes_sent": [true, "x", -1e400, 5], "clock": 7}',
    '{"kind": "membership", "members": 5, "round": [], "event": {"a": 1}}',
    "[" * 5000,
]


@pytest.mark.parametrize("state", ["", "not json", "[1]", '{"slots": 3, "port": "x"}'])
def test_bad_content_is_skipped_never_raised(tmp_path, state):
    run = tmp_path / "run"
    run.mkdir()
    empty = status.snapshot(run)  # nothing there at all
    assert empty["slots"] == [] and empty["rounds"] == [] and not any(empty["found"].values())
    (run / "coordinator.json").write_text(state)
    (run / "coordinator.log").write_bytes(b"\xff\xfe garbage \x00\n10:00:01 machine  () joined:")
    (run / "metrics.jsonl").write_text("\n".join(BAD) + "\n")
    snap = status.snapshot(run)
    assert [r["round"] for r in snap["rounds"]] == [1, 2, 3]
    assert [(r["loss"], r["wall_s"], r["step"]) for r in snap["rounds"]][:2] == [(None,) * 3] * 2
    assert [s["bytes_sent"] for s in snap["slots"]] == [None, None, None, 5]
    assert snap["membership"][0]["members"] == [] and snap["membership"][0]["round"] is None
    for render in (status.render_html, status.render_prom, status.render_text):
        assert render(snap)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_the_page_shows_members_and_loss_and_escapes_every_name(run_dir):
    page = status.render_html(status.snapshot(run_dir))
    parser = _Tags()
    parser.feed(page)
    tags = parser.tags
    assert not [t for t, _ in tags if t in ("script", "iframe", "img", "link", "object")]
    assert not [
        a for _, a in tags if {"src", "href"} & set(a) or any(k.startswith("on") for k in a)
    ]
    assert HOSTILE not in page and html_escaped(HOSTILE) in page
    ids = {a.get("id") for _, a in tags}
    assert {"members", "slots", "loss", "membership", "log", "summary"} <= ids
    (train,) = [a for t, a in tags if t == "polyline" and a.get("class") == "train"]
    points = train["points"].split()
    assert len(points) == 3  # one per round
    xs = [float(p.split(",")[0]) for p in points]
    ys = [float(p.split(",")[1]) for p in points]
    assert xs == sorted(xs) and ys == sorted(ys)  # later and lower loss: further right, lower
    (val,) = [a for t, a in tags if t == "polyline" and a.get("class") == "val"]
    assert len(val["points"].split()) == 1
    assert ("meta", {"http-equiv": "refresh", "content": "5"}) in tags
    assert "measured" in page and "model-counted" in page  # every figure says what it is


def html_escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


SAMPLE = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>([a-zA-Z_]\w*="(\\[\\"n]|[^"\\\n])*",?)*)\})?'
    r" (?P<value>-?[0-9.]+(e[+-]?[0-9]+)?)"
)


def test_the_prom_file_is_the_textfile_format(run_dir):
    snap = status.snapshot(run_dir)
    text = status.render_prom(snap)
    assert text.endswith("\n")
    typed, samples = set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert line.split()[2].startswith("frugaltrain_")
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("gauge", "counter") and name not in typed
            typed.add(name)
        else:
            m = SAMPLE.fullmatch(line)
            assert m, line
            assert m["name"] in typed  # its TYPE came first
            samples[m["name"] + (m.group(2) or "")] = float(m["value"])
    assert samples["frugaltrain_round"] == 3 and samples["frugaltrain_loss"] == 3.5
    assert samples["frugaltrain_members"] == 3 and samples["frugaltrain_workers"] == 2
    assert samples['frugaltrain_slots{state="held"}'] == 3
    assert samples['frugaltrain_slots{state="free"}'] == 1
    assert samples['frugaltrain_bytes_sent_total{worker="0"}'] == 1200
    assert 'frugaltrain_bytes_sent_total{worker="3"}' not in samples  # never counted: left out
    assert samples["frugaltrain_membership_changes_total"] == 1
    snap["slots"][0]["name"] = 'a"b\\c\nd'  # the exposition format's escapes
    assert 'machine="a\\"b\\\\c\\nd"' in status.render_prom(snap)


def test_a_byte_counter_keeps_every_digit(run_dir):
    snap = status.snapshot(run_dir)
    snap["slots"][0]["bytes_sent"] = 123456789012
    assert 'frugaltrain_bytes_sent_total{worker="0"} 123456789012\n' in status.render_prom(snap)


def test_the_terminal_view_is_printable(run_dir):
    with open(run_dir / "coordinator.log", "a") as f:
        f.write("10:00:12 machine \x1b[2Jwiped joined nothing\n")
    text = status.render_text(status.snapshot(run_dir))
    assert "\x1b" not in text and all(line.isprintable() for line in text.splitlines())
    assert "round 3" in text and "alpha" in text and HOSTILE in text and "left" in text


def test_write_replaces_both_files_whole(run_dir):
    before = set(run_dir.iterdir())
    status.write(run_dir)
    status.write(run_dir)
    assert {p.name for p in set(run_dir.iterdir()) - before} == {"status.html", "metrics.prom"}
    assert (run_dir / "status.html").read_text().startswith("<!DOCTYPE html>")
    assert "frugaltrain_round 3" in (run_dir / "metrics.prom").read_text()


def test_the_writer_writes_until_stopped_and_says_a_failure_once(run_dir, tmp_path):
    said: list[str] = []
    status.StatusWriter(run_dir, said.append, every_s=60).start().stop()
    assert (run_dir / "status.html").is_file() and said == []
    gone = tmp_path / "gone"
    status.StatusWriter(gone, said.append, every_s=60).start().stop()  # two tries, one line
    assert len(said) == 1 and "could not write status.html" in said[0]


def test_the_state_file_is_the_coordinators():
    assert status.STATE == COORDINATOR_STATE


def test_the_command_prints_the_status_or_one_line_for_no_run(run_dir, tmp_path, capsys):
    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "round 3" in out and "held" in out
    missing = tmp_path / "nope"
    assert cli.main(["status", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0]
    assert cli.main(["status", str(tmp_path)]) == 2  # a directory, but no run's


def test_the_page_in_a_real_browser(run_dir, tmp_path):
    """Headless Chromium loads the page from disk, draws it and shows its elements."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("needs chromium (Debian package chromium)")
    status.write(run_dir)
    url = (run_dir / "status.html").as_uri()
    png = tmp_path / "status.png"
    flags = [browser, "--headless", "--disable-gpu", "--no-sandbox"]
    flags += [f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,900"]
    subprocess.run([*flags, f"--screenshot={png}", url], capture_output=True, timeout=90)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    done = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=True
    )
    dom = done.stdout
    assert "<title>frugaltrain status: mach</title>" in dom
    assert '<table id="members">' in dom and "<svg" in dom and 'class="train"' in dom
    assert HOSTILE not in dom and html_escaped(HOSTILE) in dom  # shown as text, not run
    assert dom.count("<tr") >= 1 + 3 + 1 + 4  # the machines' header and rows, the slots'
