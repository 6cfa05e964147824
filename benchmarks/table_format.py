"""The tables of result files that a benchmark script prints and benchmarks/tables.py also writes
into the docs, so that both draw them from one place: compression.py, data_prep.py, faults.py,
machines.py, netlab_validation.py and worker_start.py import their table from here (time
to loss's tables are in time_to_loss_analysis.py). The dependency goes one way: the scripts and
tables.py import this module, it imports none of them (nor torch, nor frugaltrain), and a script
finds it as `from table_format import ...` (its own directory is on sys.path when it runs as
`python benchmarks/NAME.py`).

Each table takes the JSON of one result file, or its rows, and returns Markdown (compression's
cells are the numbers of a table, which compression.py and tables.py each lay out).
"""

from __future__ import annotations

import statistics


def row(cells: list[str]) -> str:
    """A Markdown table row; an empty cell stays empty (`| |`)."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


# ---------------------------------------------------------------- compression.py

CODECS = "fp32,bf16,int8,e3m0,topk:0.1,topk:0.01,topk:0.001"
CODECS += ",topk:0.1+2bit,topk:0.01+2bit,topk:0.001+2bit"  # its codecs, in the tables' order


def compression_cells(rows: list[dict], methods: list[str], codecs: list[str]) -> list[dict]:
    """One line per method x codec over the seeds in `rows` (compression.py's runs): MB per
    round, how many times fewer bytes than fp32 DiLoCo, val loss and its ratio to fp32 DiLoCo
    paired by seed (each as values over seeds), util. Empty without an fp32 DiLoCo run to
    compare with."""
    ref = {r["seed"]: r for r in rows if r["method"] == "diloco" and r["codec"] == "fp32"}
    if not ref:
        return []
    ref_bytes = statistics.mean(r["bytes_per_round"] for r in ref.values())
    out = []
    for m in methods:
        for c in codecs:
            got = [r for r in rows if r["method"] == m and r["codec"] == c]
            if not got:
                continue
            nbytes = statistics.mean(g["bytes_per_round"] for g in got)
            out.append(
                {
                    "method": m,
                    "codec": c,
                    "mb": nbytes / 1e6,
                    "fewer": ref_bytes / nbytes,
                    "loss": [g["loss_val"] for g in got],
                    "ratio": [
                        g["loss_val"] / ref[g["seed"]]["loss_val"] for g in got if g["seed"] in ref
                    ],
                    "util": statistics.mean(g["util_measured"] for g in got),
                }
            )
    return out


# ---------------------------------------------------------------- data_prep.py


def _data_read(args: list[str]) -> str:
    """What a `frugaltrain data` command read: its --max-bytes in MB, or the whole corpus."""
    if "--max-bytes" not in args:
        return "all"
    return f"{int(args[args.index('--max-bytes') + 1]) / 1e6:g} MB"


def data_prep_table(record: dict) -> str:
    """Each data command's wall time (median and range over repetitions), what it read (from
    its recorded arguments) and the tokens of the shards it wrote."""
    reps = record["measured.repetitions"]
    lines = ["| step | input | tokens (train / val) | wall: median (range) |", "|---|---|---|---|"]
    for name, args in record["variants"].items():
        walls = [r[name]["wall_s"] for r in reps]
        tokens = ""
        if "shards" in reps[0][name]:
            sp = reps[0][name]["shards"]["splits"]
            tokens = f"{sp['train']['tokens']:,} / {sp['val']['tokens']:,}"
        wall = f"{statistics.median(walls):.1f} s ({min(walls):.1f}-{max(walls):.1f})"
        lines.append(f"| {name} | {_data_read(args)} | {tokens} | {wall} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- faults.py

STRATEGY_NAMES = {"fgd": "fgd (GlobalM1LocalM2)"}  # a strategy's row label, if not its name


def _fault_cell(reps: list[dict]) -> str:
    """Median wall-time overhead [min-max], then the medians of worker-rounds lost, recovery per
    worker and the final loss against the clean run's."""
    over = [r["overhead"] for r in reps]
    lost = statistics.median(r["faulted"]["worker_rounds_lost"] for r in reps)
    rec = statistics.median(r["faulted"]["recovery_s"] for r in reps)
    loss = statistics.median(r["loss_ratio"] for r in reps)
    spread = f" [{min(over):.2f}-{max(over):.2f}]" if len(over) > 1 else ""
    return f"{statistics.median(over):.2f}x{spread}, {lost:g} lost, {rec:.1f} s, {loss:.3f}"


def faults_table(result: dict) -> str:
    """The fault matrix as Markdown: a row per strategy, a column per fault."""
    rows = result["matrix"]
    faults = list(dict.fromkeys(r["fault"] for r in rows))
    head = {"partition": "partition 10 s", "stall": "stall 20 s", "corrupt": "corrupt 1e30"}
    lines = [
        "| strategy | " + " | ".join(head.get(f, f) for f in faults) + " |",
        "|---" * (len(faults) + 1) + "|",
    ]
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        cells = {r["fault"]: _fault_cell(r["reps"]) for r in rows if r["strategy"] == strategy}
        name = STRATEGY_NAMES.get(strategy, strategy)
        lines.append(f"| {name} | " + " | ".join(cells[f] for f in faults) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- machines.py


def machines_table(result: dict) -> str:
    """The Markdown table of a result file: each figure's mean and min-max over repetitions."""
    a = result["args"]
    reps = result["reps"]
    found = [rep["machine_loss"]["detected_by"] for rep in reps]
    by = ", ".join(f"{m} ({found.count(m)}/{len(found)})" for m in sorted(set(found)))
    equal = sum(all(rep["join"]["match"]) and bool(rep["join"]["match"]) for rep in reps)
    lines = [
        f"{a['machines']} machines at {a['rate_mbit']:g} Mbit/s, {a['machine_cpu']:g} core "
        f"each, {a['rounds']} rounds of H = {a['H']}; {len(reps)} repetition(s); a machine's loss "
        f"found by: {by}; the joiner's state equal to its donor's: {equal}/{len(reps)}",
        "",
        "| event | figure | mean | min-max | kind |",
        "|---|---|---|---|---|",
    ]
    for f in result["figures"]:
        fmt = f["format"]
        mean = format(f["mean"], {"d": ".1f", ",d": ",.0f"}.get(fmt, fmt))
        spread = f"{f['min']:{fmt}}-{f['max']:{fmt}}"
        lines.append(f"| {f['event']} | {f['figure']} | {mean} | {spread} | {f['kind']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- netlab_validation.py


def netlab_rows(data: dict | list) -> list[dict]:
    """The cases of a results file: its "rows", or the file itself when it is the bare list that
    files written before provenance was recorded hold."""
    return data["rows"] if isinstance(data, dict) else data


def _against(pred: float, measured: float, digits: int = 0) -> str:
    """A prediction, with the measured figure relative to it."""
    return f"{pred:.3f} ({(measured / pred - 1) * 100:+.{digits}f}%)"


def netlab_table(data: dict | list) -> str:
    """Measured utilization on the rate-limited links beside each prediction, with the measured
    figure relative to each prediction."""
    lines = [
        "| rate | method | step c (s), measured | r (probed) | **U measured** "
        "| closed form, probed link | simulator, probed link | simulator, measured inputs "
        "| closed form, nominal link | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in netlab_rows(data):
        u = r["measured"]["U"]
        cells = [f"{r['rate_mbit']:g} Mbit/s", r["method"], f"{r['measured']['step_s']:.3f}"]
        cells += [f"{r['r_probe_estimated']:.2f}", f"**{u:.3f}**"]
        cells += [
            _against(r["U_closed_form_probe_estimated"], u),
            _against(r["U_simulated_probe"], u),
        ]
        cells += [_against(r["U_simulated_measured_inputs"], u, 1)]
        cells += [_against(r["U_closed_form_nominal_estimated"], u)]
        lines.append(row([*cells, f"{r['load_avg_1min_before']:.1f}"]))
    return "\n".join(lines)


# ---------------------------------------------------------------- worker_start.py


def worker_start_table(record: dict) -> str:
    """Each way's start and restart (wall and CPU s, median and min-max over repetitions), and
    forkserver's over spawn's."""
    runs = record["runs"]
    med = lambda way, k: statistics.median(r[k] for r in runs[way])  # noqa: E731
    span = lambda way, k: f"{min(r[k] for r in runs[way]):.2f}-{max(r[k] for r in runs[way]):.2f}"  # noqa: E731
    lines = [
        f"{record['workers']} workers, {record['reps']} repetitions, {record['machine']['cores']} "
        "cores (measured; median, min-max):",
        "",
        "| way | start, s | its CPU, s | restart, s | its CPU, s |",
        "|---|---|---|---|---|",
    ]
    for way in runs:  # the ways in the order they ran
        cells = [f"{med(way, k):.2f} ({span(way, k)})" for k in runs[way][0]]
        lines.append(f"| {way} | " + " | ".join(cells) + " |")
    ratio = {k: med("forkserver", k) / med("spawn", k) for k in runs["spawn"][0]}
    lines.append("| forkserver x spawn | " + " | ".join(f"{v:.2f}" for v in ratio.values()) + " |")
    return "\n".join(lines)
