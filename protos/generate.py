"""Regenerate the Python stubs of every `.proto` in this folder (`python -m protos.generate`).

The stubs are generated with the repository root as the only include path, so a proto's imports read
`import "protos/common.proto";` and the generated modules import each other as
`from protos import common_pb2`: they work wherever the `protos` package is importable. For each
`NAME.proto` this writes `NAME_pb2.py` (messages), `NAME_pb2.pyi` (types) and `NAME_pb2_grpc.py`
(service stubs and servicers).

NOTE: the output depends on the grpcio-tools version (its bundled protoc); the committed stubs are
those of the version pinned in pyproject.toml, and `tests/protos/test_stubs.py` checks they are
up to date. Never edit the stubs by hand.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
"""This folder: the `.proto` sources and the committed stubs."""
ROOT_DIR = PROTOS_DIR.parent
"""The include root: proto paths and generated imports are relative to it."""


def proto_files() -> list[Path]:
    """The `.proto` sources, sorted by name."""
    return sorted(PROTOS_DIR.glob("*.proto"))


def generate(out_root: Path = ROOT_DIR) -> list[Path]:
    """Generate the stubs of every proto into `out_root/protos/`; returns the written files, sorted.

    Raises RuntimeError with protoc's exit code when protoc fails (its messages go to stderr).
    """
    out_root = Path(out_root)
    out_dir = out_root / "protos"
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(p.relative_to(ROOT_DIR)) for p in proto_files()]
    # NOTE: protoc runs in a child process. Loading grpc_tools' bundled protobuf C++ into a process
    # that already holds torch (and other native libraries) crashed with a segmentation fault in CI.
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--proto_path={ROOT_DIR}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(ROOT_DIR / s) for s in sources],
    ]
    code = subprocess.run(args, check=False).returncode
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} on {sources}")
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT_DIR, help="output root; stubs go to OUT/protos/ (default: the repository root)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
