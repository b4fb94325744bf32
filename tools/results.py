"""`bumblebee results`: the benchmark result files of each slot, read back as compact tables.

Reads benchmarks/<slot>/results/**/*.json (and .jsonl: one row a line) as they are, whatever their age:
the rows are every top-level list of records ("rows", "results", "cases", ...), the columns their
scalar fields, byte counts shown in GiB; each table is headed by the file's stamp (commit, dirty
tree, device, versions: `benchmarks/stamp.py` writes it; older files say "commit unknown", with the
commit that recorded them where they name it). A slot's older runs are the lines of its
results/history.jsonl ({"file", "recorded_in_commit", "note", "result"}): listed as one table, or
each run's own tables with `history=True`.
Reads JSON only: imports nothing of the benchmarks.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks"  # one results/ folder per benchmark folder: <slot>/results/
STAMP = ("commit", "dirty", "device", "torch", "triton", "cuda", "date")
RANKS = ("ranks", "world_size", "gpus")
ROW_KEYS = ("rows", "results", "cases")  # the main table first, where a file names it so
HISTORY = "history.jsonl"  # a slot's older runs, one a line
GiB = 2 ** 30
MAX_TEXT = 28  # longer strings (error tails, notes) are cut: the file holds them whole


def load(path: Path) -> dict:
    """A result file as a dict; a .jsonl file becomes {"rows": [one record a line]}, its stamp (a first
    line with a "commit", as probes print it: `benchmarks/stamp.py` print_stamp) lifted to the top."""
    text = Path(path).read_text()
    if Path(path).suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        if rows and isinstance(rows[0], dict) and "commit" in rows[0]:
            return {**rows[0], "rows": rows[1:]}
        return {"rows": rows}
    data = json.loads(text)
    return data if isinstance(data, dict) else {"rows": data}


def slot_of(path: Path, data: dict) -> str:
    """The benchmark folder the file lies in (benchmarks/<slot>/results/...); else the file's "slot" or
    "benchmark" key; else its name."""
    parts = Path(path).parts
    if "results" in parts[1:]:
        return parts[len(parts) - 1 - parts[::-1].index("results") - 1]
    for key in ("slot", "benchmark"):
        if isinstance(data.get(key), str):
            return data[key]
    return Path(path).stem


def files(directory: Path = RESULTS_DIR) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no results folder at {directory}")
    return sorted(p for p in directory.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())


def is_older_run(path: Path, directory: Path = RESULTS_DIR) -> bool:
    """A history.jsonl, or a file under a history/ or before_* folder: a run the current files replaced."""
    return Path(path).name == HISTORY or any(part == "history" or part.startswith("before_")
                                             for part in Path(path).relative_to(directory).parts)


def by_slot(directory: Path = RESULTS_DIR) -> dict[str, list[Path]]:
    """{slot: its result files}, current files (outside history/ and before_* folders) first."""
    directory, out = Path(directory), {}
    for path in files(directory):
        out.setdefault(slot_of(path.relative_to(directory), load(path)), []).append(path)
    return {slot: sorted(paths, key=lambda p: (is_older_run(p, directory), str(p))) for slot, paths in sorted(out.items())}


def tables(data: dict) -> list[tuple[str, list[dict]]]:
    """(name, records) of every top-level list of records, the usual row keys first."""
    keys = [k for k in ROW_KEYS if k in data] + [k for k in data if k not in ROW_KEYS]
    return [(k, [r for r in data[k] if isinstance(r, dict)]) for k in keys
            if isinstance(data[k], list) and any(isinstance(r, dict) for r in data[k])]


def stamp_line(data: dict, rows: list[dict]) -> str:
    """commit, dirty flag, device, ranks, versions and date: the file's own, else what every row shares."""
    def value(key):
        if key in data:
            return data[key]
        seen = {json.dumps(r.get(key)) for r in rows}
        return rows[0].get(key) if rows and len(seen) == 1 else None
    commit, dirty = value("commit"), value("dirty")
    parts = [f"commit {commit[:12]}" if commit else "commit unknown"]
    if not commit and value("recorded_in_commit"):  # written before the stamp: the commit that added it
        parts[0] += f" (recorded in {value('recorded_in_commit')})"
    if commit:
        parts.append({True: "dirty tree", False: "clean tree", None: "dirty unknown"}.get(dirty, f"dirty {dirty}"))
    parts += [f"{key} {value(key)}" for key in ("device", *RANKS, "torch", "triton", "cuda", "date")
              if value(key) is not None]
    return " | ".join(parts)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def columns(rows: list[dict]) -> list[str]:
    """Scalar fields in first-seen order; a stamp field only where rows differ; none that is empty
    in every row."""
    cols = []
    for r in rows:
        cols += [k for k, v in r.items() if k not in cols and _scalar(v)]
    keep = []
    for k in cols:
        values = [r.get(k) for r in rows]
        if all(v is None for v in values) or any(not _scalar(v) for v in values):
            continue
        if k in STAMP and len({json.dumps(v) for v in values}) == 1:
            continue
        keep.append(k)
    return keep


def _header(col: str) -> str:
    return col[: -len("_bytes")] + "_GiB" if col.endswith("_bytes") else col


def cell(col: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if col.endswith("_bytes") and isinstance(v, (int, float)):
        return f"{v / GiB:.2f}"
    if isinstance(v, float):  # about four significant digits, never an exponent above 1
        size = abs(v) if v == v else 0.0
        return f"{v:.0f}" if size >= 1e4 else f"{v:.1f}" if size >= 100 else f"{v:.2f}" if size >= 1 else f"{v:.3g}"
    text = str(v).replace("\n", " ")
    return text if len(text) <= MAX_TEXT or col == "file" else text[: MAX_TEXT - 3] + "..."  # a history's file: whole


def render_rows(rows: list[dict]) -> str:
    cols = columns(rows)
    if not cols:
        return "  (no scalar fields)"
    grid = [[_header(c) for c in cols]] + [[cell(c, r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(cols))]
    numeric = [all(_numeric(r.get(c)) for r in rows) for c in cols]
    lines = ["  ".join(t.rjust(w) if num else t.ljust(w) for t, w, num in zip(line, widths, numeric)).rstrip()
             for line in grid]
    return "\n".join("  " + line for line in lines)


def _numeric(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _name(path: Path, base: Path | None) -> str:
    return str(path.relative_to(base)) if base and path.is_relative_to(base) else str(path)


def render_file(path: Path, base: Path | None = None) -> str:
    """The file's name, its stamp, and a table per list of records in it."""
    path = Path(path)
    return render_data(_name(path, base), load(path))


def render_history(path: Path, base: Path | None = None) -> str:
    """Every older run of a history.jsonl with its own tables, headed by the file it was kept in, the
    commit that recorded it and what the run was."""
    path = Path(path)
    return "\n\n".join(render_data(f"{_name(path, base)}: {e['file']}", {"recorded_in_commit": e.get("recorded_in_commit"),
                                                                         **e["result"]}, note=e.get("note"))
                       for e in load(path)["rows"])


def render_data(name: str, data: dict, note: str | None = None) -> str:
    found = tables(data)
    out = [f"== {name}", f"   {stamp_line(data, found[0][1] if found else [])}"] + ([f"   {note}"] if note else [])
    if not found:
        out.append("  (no rows)")
    for key, rows in found:
        if len(found) > 1 or key not in ROW_KEYS:
            out.append(f"  [{key}]")
        out.append(render_rows(rows))
    return "\n".join(out)


def render_listing(slots: dict[str, list[Path]], base: Path) -> str:
    lines = []
    for slot, paths in slots.items():
        lines.append(slot)
        lines += [f"  {p.relative_to(base)}" for p in paths]
    return "\n".join(lines)


def main(slot: str | None = None, file: str | None = None, directory: str | None = None, history: bool = False) -> str:
    """What `bumblebee results [SLOT] [--file PATH] [--dir DIR] [--history]` prints; ValueError for an
    unknown slot. `history`: each older run of a history.jsonl as its own tables, not one line each."""
    def render(p, base=None):
        return render_history(p, base) if history and Path(p).name == HISTORY else render_file(p, base)
    if file:
        return render(Path(file))
    base = Path(directory) if directory else RESULTS_DIR
    slots = by_slot(base)
    if slot is None:
        return render_listing(slots, base)
    if slot not in slots:
        raise ValueError(f"no result files for slot {slot!r} under {base}; slots with results: {', '.join(slots)}")
    return "\n\n".join(render(p, base) for p in slots[slot])
