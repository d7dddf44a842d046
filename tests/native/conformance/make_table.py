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

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from native.conformance.compare import Outcome, compare, missing_renderer, native_renderer
from native.conformance.foreign import (
    ForeignTarget,
    foreign_targets,
    hf_assistant_mask,
    native_render,
)
from native.conformance.foreign import hf_render as foreign_hf_render
from native.conformance.foreign import hf_tokenizer as foreign_tokenizer
from native.conformance.foreign import native_renderer as foreign_renderer
from native.conformance.oracle import hf_render as family_hf_render
from native.conformance.targets import TARGET_NAMES, target
from testkit.paths import REPO_ROOT
from treadle_native.conformance.bridging import bridge_outcomes
from treadle_native.conformance.corpus import KINDS, Case, cases


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=240, help="cases per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "native" / "CONFORMANCE.md")
    parser.add_argument("--targets", nargs="*", default=list(TARGET_NAMES), choices=TARGET_NAMES)
    parser.add_argument(
        "--foreign-n", type=int, default=40, help="cases per foreign (TRL) template; 0 skips them"
    )
    parser.add_argument(
        "--bridge-n", type=int, default=80, help="cases per target for bridge coverage; 0 skips it"
    )
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

    bridges = (
        {name: family_bridges(name, args.bridge_n) for name in args.targets}
        if args.bridge_n
        else {}
    )
    foreign = [foreign_row(t, args.foreign_n) for t in foreign_targets()] if args.foreign_n else []
    for row in foreign:
        print(f"{row.name}: {row.summary()}")
    command = shlex.join(["python", "tests/native/conformance/make_table.py", *argv])
    text = report(results, generic, command, bridges, foreign)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    everything = [
        o for group in (results, generic) for outcomes in group.values() for o in outcomes
    ]
    foreign_ok = all(r.ok for r in foreign)
    bridges_ok = all(c["wrong"] == 0 for c in bridges.values())
    return 0 if all(o.passed for o in everything) and foreign_ok and bridges_ok else 1


def family_bridges(name: str, n: int) -> Counter[str]:
    """Bridge outcomes of a family target's corpus (`treadle_native.conformance.bridging`)."""
    total: Counter[str] = Counter()
    for case in cases(name, n):

        def render(msgs: list[dict[str, Any]], agp: bool, case: Case = case) -> list[int]:
            c = Case(case.id, case.kinds, msgs, case.tools, agp, case.template_kwargs)
            return family_hf_render(name, c).token_ids

        total += bridge_outcomes(native_renderer(name).renderer, render, case)
    return total


@dataclass
class ForeignRow:
    name: str
    tokenizer: str
    stand_in: bool
    sha256: str
    same: int = 0  # transformers renders, native identical
    rendered: int = 0  # transformers renders
    both_raise: int = 0
    native_only: int = 0  # native renders where transformers raises
    first_problem: str = ""
    masks_ok: int = 0
    masks: int = 0
    bridges: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return (
            self.same == self.rendered
            and self.native_only == 0
            and self.masks_ok == self.masks
            and self.bridges["wrong"] == 0
        )

    def summary(self) -> str:
        eligible = self.bridges["ok"] + self.bridges["missed"]
        return (
            f"{self.same}/{self.rendered} identical, {self.both_raise} rejected by both, "
            f"{self.native_only} rendered where transformers raises; masks {self.masks_ok}/"
            f"{self.masks}; bridges {self.bridges['ok']}/{eligible}, wrong {self.bridges['wrong']}"
        )


def foreign_row(t: ForeignTarget, n: int) -> ForeignRow:
    import treadle_native

    row = ForeignRow(t.name, t.folder, t.stand_in, t.template_sha256())
    tok = foreign_tokenizer(t.folder)
    for case in cases("generic", n):
        try:
            hf = foreign_hf_render(t, case)
        except Exception:
            try:
                native_render(t, case)
                row.native_only += 1
                row.first_problem = (
                    row.first_problem or f"{case.id}: rendered where transformers raises"
                )
            except treadle_native.TreadleNativeError:
                row.both_raise += 1
            continue
        row.rendered += 1
        try:
            out = native_render(t, case)
        except treadle_native.TreadleNativeError as e:
            row.first_problem = row.first_problem or f"{case.id}: {e}"
            continue
        if out.text == hf.text and out.token_ids.tolist() == hf.token_ids:
            row.same += 1
        else:
            row.first_problem = row.first_problem or f"{case.id}: text or ids differ"
            continue
        if t.has_generation:
            row.masks += 1
            row.masks_ok += out.loss_mask.tolist() == hf_assistant_mask(t, case)

        def render(msgs: list[dict[str, Any]], agp: bool, case: Case = case) -> list[int]:
            text = tok.apply_chat_template(
                msgs, tools=case.tools, add_generation_prompt=agp, tokenize=False,
                chat_template=t.template_text, **case.template_kwargs,
            )  # fmt: skip
            return list(tok(text, add_special_tokens=False)["input_ids"])

        row.bridges += bridge_outcomes(foreign_renderer(t.name), render, case)
    return row


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
    results: dict[str, list[Outcome]],
    generic: dict[str, list[Outcome]],
    command: str,
    bridges: dict[str, Counter[str]] | None = None,
    foreign: list[ForeignRow] | None = None,
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
        "others the renderer says so and locates message fields instead (a render with them marked).",
        "",
        *_table(generic, extra="prefix-stable"),
    ]
    if bridges:
        lines += [
            "",
            "## Bridges (family ports)",
            "",
            "For each point of a conversation after an assistant turn: transformers' ids up to "
            "there, and its full re-render up to the next assistant turn. *eligible*: the "
            "re-render keeps the previous ids as a prefix; *exact*: the bridge returned exactly "
            "the re-render; *wrong*: a bridge that returned other ids (must be 0); *refused*: "
            "not eligible, and the bridge said so.",
            "",
            "| target | exact / eligible | wrong | refused |",
            "|---|---:|---:|---:|",
        ]
        for name, c in bridges.items():
            lines.append(
                f"| {name} | {c['ok']}/{c['ok'] + c['missed']} | {c['wrong']} | {c['refused']} |"
            )
    if foreign:
        lines += [
            "",
            "## Foreign templates (generic renderer)",
            "",
            "TRL's reference chat templates (`trl/chat_templates/*.jinja` from the trl wheel, "
            'not copied here), each rendered by `Renderer("jinja", chat_template=...)` on the '
            "`generic` corpus and by transformers. *identical*: of the cases transformers "
            "renders; *both reject*: transformers raises and so does the renderer; *renders "
            "alone*: the renderer renders a case transformers rejects (must be 0). *masks*: "
            "templates with `{% generation %}`, loss mask vs transformers' `assistant_masks`. "
            "*bridges*: as above. A template of a family we have no tokenizer for is paired "
            "with the Qwen3 tokenizer (*stand-in*): text is compared exactly, ids with that "
            "tokenizer on both sides.",
            "",
            "| template | tokenizer | identical | both reject | renders alone | masks | "
            "bridges exact / eligible | wrong | template sha256 |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in foreign:
            tok = f"{r.tokenizer} (stand-in)" if r.stand_in else r.tokenizer
            masks = f"{r.masks_ok}/{r.masks}" if r.masks else "–"
            eligible = r.bridges["ok"] + r.bridges["missed"]
            lines.append(
                f"| {r.name} | {tok} | {r.same}/{r.rendered} | {r.both_raise} | {r.native_only} "
                f"| {masks} | {r.bridges['ok']}/{eligible} | {r.bridges['wrong']} "
                f"| `{r.sha256[:16]}…` |"
            )
        bad = [r for r in foreign if not r.ok]
        lines += ["", f"Foreign templates with a problem: {len(bad)}"]
        lines += [f"- `{r.name}`: {r.summary()}; first: {r.first_problem}" for r in bad]
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
