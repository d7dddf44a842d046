"""Regenerate the committed Python code of Treadle's protobuf contracts.

    python proto/generate.py           # rewrite proto/treadle/proto/v1/*_pb2*.py(i)
    python proto/generate.py --check   # exit 1 if the committed code is stale

The generator is grpcio-tools (pinned in the workspace's dev extra) so the output is
byte-stable; the test suite runs ``--check`` and fails on any difference.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "treadle" / "proto" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every ``.proto`` of v1, writing generated modules below ``out_dir``.

    Returns the generated files, relative to ``out_dir``.
    """
    from grpc_tools import protoc

    sources = sorted(PACKAGE_DIR.glob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"no .proto files in {PACKAGE_DIR}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(s.relative_to(PROTO_ROOT)) for s in sources),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
    rel_pkg = PACKAGE_DIR.relative_to(PROTO_ROOT)
    return sorted(
        p.relative_to(out_dir)
        for p in (out_dir / rel_pkg).iterdir()
        if p.name.endswith(GENERATED_SUFFIXES)
    )


def committed_files() -> list[Path]:
    """Generated files currently in the source tree, relative to ``proto/``."""
    return sorted(
        p.relative_to(PROTO_ROOT)
        for p in PACKAGE_DIR.iterdir()
        if p.name.endswith(GENERATED_SUFFIXES)
    )


def stale_files() -> list[str]:
    """Describe every difference between fresh generator output and the committed files."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        fresh = generate(out)
        committed = committed_files()
        problems = [f"missing from the tree: {p}" for p in sorted(set(fresh) - set(committed))]
        problems += [
            f"not produced by the generator: {p}" for p in sorted(set(committed) - set(fresh))
        ]
        for rel in sorted(set(fresh) & set(committed)):
            if not filecmp.cmp(out / rel, PROTO_ROOT / rel, shallow=False):
                problems.append(f"differs from fresh output: {rel}")
        return problems


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    if args.check:
        problems = stale_files()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print(
                "generated protobuf code is stale: run `python proto/generate.py`", file=sys.stderr
            )
            return 1
        print("generated protobuf code is up to date")
        return 0
    for old in committed_files():
        (PROTO_ROOT / old).unlink()
    written = generate(PROTO_ROOT)
    for rel in written:
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
