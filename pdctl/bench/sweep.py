"""`pdctl sweep`: `pdctl bench` for each case of a matrix, resumable, with one combined report and plots."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pdctl.topology import REMOVED_OVERRIDE_FLAGS, ROLE_FLAGS, Override, TopologyError

# A case's keys that became `set:` paths (the command line's override flags, snake_case): refused with the `set:`
# that replaces them; a case changes the topology one way.
REMOVED_CASE_KEYS = {**{flag[2:].replace("-", "_"): ".".join(path) for flag, path in ROLE_FLAGS.items()},
                     **{flag[2:].replace("-", "_"): s.partition("=")[0] for flag, s in REMOVED_OVERRIDE_FLAGS.items()}}


class Case(BaseModel):
    """One run of the sweep: a name, and the topology's fields it changes (`set:` as {dotted.path: value} or a
    list of "dotted.path=value", both as `--set`)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    set: dict[str, Any] | list[str] = Field(default_factory=dict)

    def overrides(self) -> list[Override]:
        sets = self.set if isinstance(self.set, list) else [f"{k}={json.dumps(v)}" for k, v in self.set.items()]
        return [Override.parse_set(s) for s in sets]

    def value(self, dotted: str) -> Any:
        """What the case sets at one path (None: it leaves it as the topology has it), for a case that never ran."""
        try:
            return {o.path: o.value for o in self.overrides()}.get(tuple(dotted.split(".")))
        except TopologyError:  # a --set that is not one: the case's REFUSED row says so
            return None


class Matrix(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cases: list[Case] = Field(min_length=1)


def load_matrix(path: Path) -> Matrix:
    """The matrix file, validated; ValueError with the line of a case that uses a removed key."""
    from pdctl import yamlsrc

    try:
        doc = yamlsrc.load(yamlsrc.read_file(path, "the matrix"))
    except yamlsrc.YamlSourceError as e:
        raise ValueError(f"line {e.line}: {e.message}" if e.line else e.message) from None
    cases = doc.data.get("cases") if isinstance(doc.data, dict) else None
    for i, case in enumerate(cases if isinstance(cases, list) else []):
        old = {k: v for k, v in case.items() if k in REMOVED_CASE_KEYS} if isinstance(case, dict) else {}
        if old:
            line = doc.line_of(("cases", i, next(iter(old))))
            sets = ", ".join(f"{REMOVED_CASE_KEYS[k]}: {json.dumps(v)}" for k, v in old.items())
            raise ValueError(f"{f'line {line}: ' if line else ''}case {case.get('name', i)!r}: "
                             f"{', '.join(old)}: removed: use set: {{{sets}}}")
    return Matrix.model_validate(doc.data or {})


def run_sweep(matrix: Matrix, out_dir: Path, run_case: Callable[[Case, Path], dict],
              on_case: Callable[[Case, str], None] = lambda c, s: None) -> list[dict]:
    """Run each case whose summary is not there yet (so an interrupted sweep resumes); return all summaries."""
    rows = []
    for case in matrix.cases:
        case_dir = out_dir / case.name
        done = case_dir / "summary.json"
        if done.is_file():
            on_case(case, "done earlier, kept")
            summary = json.loads(done.read_text())
        else:
            on_case(case, "running")
            summary = run_case(case, case_dir)
            case_dir.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(summary, indent=2))
        rows.append({"case": case.name, **summary})
    write_reports(rows, out_dir)
    return rows


def row(r: dict) -> dict:
    acc = r.get("accuracy", {})
    strict = next((v["measured"] for v in acc.get("verdicts", []) if v["metric"] == "exact_match,strict-match"),
                  None)
    perf = r.get("perf", {}).get("ratio", {})
    pd = r.get("perf", {}).get("pd", {})
    return {"case": r["case"], "P block": r.get("prefill_block"), "D block": r.get("decode_block"),
            "P TP": r.get("prefill_tp"), "D TP": r.get("decode_tp"),
            "parity": r.get("parity", {}).get("status", "-"), "gsm8k strict": strict,
            "agreement": acc.get("reference", {}).get("agreement"),
            "TTFT ms": pd.get("ttft_ms_p50"), "TPOT ms": pd.get("tpot_ms_p50"),
            "TTFT x agg": perf.get("ttft_ms_p50"), "TPOT x agg": perf.get("tpot_ms_p50"),
            "status": r.get("status", "-"), "error": r.get("error")}


def write_reports(rows: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2))
    table = [row(r) for r in rows]
    cols = [c for c in table[0] if c != "error"]

    def cell(v):
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(cell(t[c]) for c in cols) + " |" for t in table]
    errors = [f"- {t['case']}: {t['error']}" for t in table if t.get("error")]
    (out_dir / "sweep.md").write_text("# pdctl sweep\n\n" + "\n".join(md) + "\n" +
                                      ("\n## Errors\n\n" + "\n".join(errors) + "\n" if errors else ""))
    _plots(table, out_dir)


def _plots(table: list[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [t["case"] for t in table]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names)), 3.2))
    ax.bar(names, [t["gsm8k strict"] or 0 for t in table], color="#4c72b0")
    ax.set_ylabel("gsm8k exact_match (strict)")
    ax.set_title("accuracy per case")
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 2.2 * len(names)), 3.2))
    for ax, key, label in ((axes[0], "TTFT ms", "TTFT p50 (ms)"), (axes[1], "TPOT ms", "TPOT p50 (ms)")):
        ax.bar(names, [t[key] or 0 for t in table], color="#55a868")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "latency.png", dpi=110)
    plt.close(fig)
