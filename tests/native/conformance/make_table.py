"""Write native/CONFORMANCE.md: how much of the corpus the native renderer gets exactly right.

    python tests/native/conformance/make_table.py [--n 240] [--seed 0] [--out native/CONFORMANCE.md]

Runs every corpus case of every target through the Hugging Face oracle and through
`treadle_native.Renderer`, then writes a pass table (target x case kind, passed/total), the
totals, where each tokenizer and template came from (folder, sha256), the date and command,
and every failing case with its first differing token. A case passes when text, token ids
and the lengths of the four output arrays all agree.

When the extension has no Renderer yet, it says so and exits 2 without writing anything.
This is the only writer of the report; review its diff like any golden file.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the corpus as the tests do
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from native.conformance.compare import Outcome, compare, missing_renderer, native_renderer
from native.conformance.corpus import KINDS, cases
from native.conformance.targets import TARGET_NAMES, target

from testkit.paths import REPO_ROOT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=240, help="cases per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "native" / "CONFORMANCE.md")
    parser.add_argument("--targets", nargs="*", default=list(TARGET_NAMES), choices=TARGET_NAMES)
    args = parser.parse_args(argv)

    reason = missing_renderer()
    if reason is not None:
        print(f"not writing {args.out}: {reason}", file=sys.stderr)
        return 2

    results: dict[str, list[Outcome]] = {}
    for name in args.targets:
        results[name] = [compare(name, case) for case in cases(name, args.n, args.seed)]
        failed = sum(not o.passed for o in results[name])
        print(f"{name}: {len(results[name]) - failed}/{len(results[name])} passed")

    command = shlex.join(["python", "tests/native/conformance/make_table.py", *argv])
    args.out.write_text(report(results, command), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0 if all(o.passed for outcomes in results.values() for o in outcomes) else 1


def report(results: dict[str, list[Outcome]], command: str) -> str:
    import transformers

    import treadle_native

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Chat rendering conformance",
        "",
        "`treadle_native.Renderer` against Hugging Face `transformers` "
        "(`apply_chat_template` + the tokenizer, no added special tokens), token for token.",
        "A case passes when the text, the token ids and the lengths of the four output arrays "
        "all agree. Cells are passed/total; a case counts under every kind it has.",
        "",
        f"Generated {now} by `{command}`",
        f"(treadle_native {treadle_native.__version__}, transformers {transformers.__version__}).",
        "",
        "## Results",
        "",
        "| target | " + " | ".join(KINDS) + " | total |",
        "|---|" + "---:|" * (len(KINDS) + 1),
    ]
    for name, outcomes in results.items():
        cells = [_cell([o for o in outcomes if kind in o.kinds]) for kind in KINDS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | **{_cell(outcomes)}** |")
    everything = [o for outcomes in results.values() for o in outcomes]
    totals = [_cell([o for o in everything if kind in o.kinds]) for kind in KINDS]
    lines.append("| **all** | " + " | ".join(totals) + f" | **{_cell(everything)}** |")

    lines += [
        "",
        "## Sources",
        "",
        "| target | renderer | tokenizer folder | tokenizer.json sha256 | template | template sha256 |",
        "|---|---|---|---|---|---|",
    ]
    for name in results:
        t = target(name)
        variant = (
            f"{t.template_file} ({t.variant})" if t.variant else f"{t.template_file} (default)"
        )
        lines.append(
            f"| {name} | `{native_renderer(name).construction}` | `{_shown(t.tokenizer_dir)}` "
            f"| `{t.tokenizer_sha256()}` | {variant} | `{t.template_sha256()[:16]}…` |"
        )

    failing = [(name, o) for name, outcomes in results.items() for o in outcomes if not o.passed]
    lines += ["", f"## Failing cases ({len(failing)})", ""]
    if not failing:
        lines.append("None.")
    for _name, o in failing:
        where = (
            f"first differing token {o.first_token_diff}"
            if o.first_token_diff is not None
            else "no token diff"
        )
        lines.append(f"- `{o.case_id}` ({', '.join(o.kinds)}): {where}; {o.detail}")
    return "\n".join(lines) + "\n"


def _cell(outcomes: list[Outcome]) -> str:
    if not outcomes:
        return "–"
    return f"{sum(o.passed for o in outcomes)}/{len(outcomes)}"


def _shown(path: Path) -> str:
    """A folder as a reader can find it: relative to the checkout's parent, or site-packages."""
    for base, label in ((Path(sys.prefix), "<venv>"), (REPO_ROOT.parent, "..")):
        try:
            return f"{label}/{path.resolve().relative_to(base.resolve())}"
        except ValueError:
            continue
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
