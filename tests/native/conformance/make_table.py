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
from native.conformance.targets import TARGET_NAMES, target
from testkit.paths import REPO_ROOT
from treadle_native.conformance.corpus import KINDS, cases


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
    generic: dict[str, list[Outcome]] = {}
    for name in args.targets:
        corpus = cases(name, args.n, args.seed)
        results[name] = [compare(name, case) for case in corpus]
        generic[name] = [compare(name, case, generic=True) for case in corpus]
        for label, outcomes in ((name, results[name]), (f"{name} (jinja)", generic[name])):
            failed = sum(not o.passed for o in outcomes)
            print(f"{label}: {len(outcomes) - failed}/{len(outcomes)} passed")

    command = shlex.join(["python", "tests/native/conformance/make_table.py", *argv])
    args.out.write_text(report(results, generic, command), encoding="utf-8")
    print(f"wrote {args.out}")
    everything = [
        o for group in (results, generic) for outcomes in group.values() for o in outcomes
    ]
    return 0 if all(o.passed for o in everything) else 1


def _table(results: dict[str, list[Outcome]], extra: str = "") -> list[str]:
    lines = [
        "| target | " + " | ".join(KINDS) + " | total |" + (f" {extra} |" if extra else ""),
        "|---|" + "---:|" * (len(KINDS) + 1) + ("---:|" if extra else ""),
    ]
    for name, outcomes in results.items():
        cells = [_cell([o for o in outcomes if kind in o.kinds]) for kind in KINDS]
        stable = (
            f" {sum(bool(o.prefix_stable) for o in outcomes)}/{len(outcomes)} |" if extra else ""
        )
        lines.append(f"| {name} | " + " | ".join(cells) + f" | **{_cell(outcomes)}** |" + stable)
    everything = [o for outcomes in results.values() for o in outcomes]
    totals = [_cell([o for o in everything if kind in o.kinds]) for kind in KINDS]
    stable = (
        f" {sum(bool(o.prefix_stable) for o in everything)}/{len(everything)} |" if extra else ""
    )
    lines.append("| **all** | " + " | ".join(totals) + f" | **{_cell(everything)}** |" + stable)
    return lines


def report(
    results: dict[str, list[Outcome]], generic: dict[str, list[Outcome]], command: str
) -> str:
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
        "## Family renderers",
        "",
        *_table(results),
        "",
        "## Generic renderer",
        "",
        '`Renderer("jinja")` renders the same targets\' chat templates with minijinja (the '
        "fallback for any HF template). *prefix-stable* counts the conversations whose every "
        "prefix rendered as a prefix of the next, where message attribution is exact; for the "
        "others the renderer says so and locates message contents instead.",
        "",
        *_table(generic, extra="prefix-stable"),
    ]
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

    failing = [
        (name, o)
        for group in (results, generic)
        for name, outcomes in group.items()
        for o in outcomes
        if not o.passed
    ]
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
    """A folder as a reader can find it: relative to the checkout's parent, or site-packages
    (symlinked checkouts are tried as given first, then resolved)."""
    for base, label in ((Path(sys.prefix), "<venv>"), (REPO_ROOT.parent, "..")):
        for p, b in ((path.absolute(), base.absolute()), (path.resolve(), base.resolve())):
            try:
                return f"{label}/{p.relative_to(b)}"
            except ValueError:
                continue
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
