"""The fault-injection scenarios (`kvferry.deploy.fault_scenarios`, which tests/reliability/ runs too)
as a report: one local cluster (2 prefill, 2 decode workers, 1 pool node, a router with --max-inflight
12, the cluster secret and an API key), every scenario (or those named) run on it in turn, each row of
docs/reliability.md's table from one ScenarioResult.

    python bench/reliability.py [--out DIR] [--scenarios kill-decode,fuzz,...] [--update-doc]

OUT gets reliability.json (every result, with notes and examples of anything wrong); the Markdown table
is printed, and with --update-doc written between the markers in docs/reliability.md. Exit status 1
when a scenario did not pass (a wrong token, a hang, a leak, an unclean failure or a broken expectation).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kvferry.deploy.fault_harness import FaultCluster, ScenarioResult, fixed_prompts, reference_tokens
from kvferry.deploy.fault_scenarios import MAX_INFLIGHT, SCENARIOS, Context
from kvferry.model.create import resolve_model
from kvferry.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability-table:begin -->", "<!-- reliability-table:end -->"
API_KEY = "reliability-api-key"


def table(results: list[ScenarioResult]) -> str:
    head = (
        "| scenario | sent | correct | resumed | failed cleanly (codes) | wrong tokens | hung | leaked | s | "
        "expected | pass |\n|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|\n"
    )
    rows = []
    for r in results:
        codes = ", ".join(f"{c} {n}" for c, n in sorted(r.codes.items())) or "-"
        rows.append(
            f"| {r.name} | {r.sent} | {r.ok} | {r.resumed} | {r.failed} ({codes}) | {r.wrong} | {r.hung} "
            f"| {r.leaked} "
            f"| {r.seconds:.0f} | {r.expectation} | {'yes' if r.passed else 'NO'} |"
        )
    return head + "\n".join(rows) + "\n"


def update_doc(text: str, doc: Path = DOC) -> None:
    body = doc.read_text()
    start, end = body.index(BEGIN) + len(BEGIN), body.index(END)
    doc.write_text(body[:start] + "\n" + text + body[end:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="where reliability.json goes (default: a temp dir)")
    p.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of: {', '.join(SCENARIOS)}"
    )
    p.add_argument("--update-doc", action="store_true", help=f"write the table into {DOC.relative_to(ROOT)}")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="kvferry-reliability-"))
    out.mkdir(parents=True, exist_ok=True)

    model_dir = resolve_model("tiny", load_settings().models_dir)
    prompts = fixed_prompts()
    refs = reference_tokens(model_dir, prompts)
    results = []
    t0 = time.monotonic()
    cluster = FaultCluster(model_dir, out, max_inflight=MAX_INFLIGHT, api_keys=(API_KEY,))
    with cluster:
        ctx = Context(cluster, prompts, refs)
        for name in names:
            print(f"reliability: {name} ...", file=sys.stderr, flush=True)
            result = SCENARIOS[name](ctx)
            results.append(result)
            print(
                f"reliability: {name}: {'pass' if result.passed else 'FAIL'} {result.problems}",
                file=sys.stderr,
            )
    summary = {
        "scenarios": [asdict(r) | {"passed": r.passed} for r in results],
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / "reliability.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = table(results)
    print(text)
    if args.update_doc:
        update_doc(text)
    print(f"results: {out / 'reliability.json'}", file=sys.stderr)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
