"""Regenerate the Python stubs of every `.proto` in this folder (`python -m deepinfer.protos.generate`).

The package installs as `deepinfer.protos` (the repository's `protos/` folder), so the stubs are
generated from an include root where this folder appears as `deepinfer/protos/`: a proto's imports read
`import "deepinfer/protos/common.proto";` and the generated modules import each other as
`from deepinfer.protos import common_pb2`. For each
`NAME.proto` this writes `NAME_pb2.py` (messages), `NAME_pb2.pyi` (types) and `NAME_pb2_grpc.py`
(service stubs and servicers).

NOTE: the output depends on the grpcio-tools version (its bundled protoc); the committed stubs are
those of the version pinned in pyproject.toml, and `tests/protos/test_stubs.py` checks they are
up to date. Never edit the stubs by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
"""This folder: the `.proto` sources and the committed stubs."""
PACKAGE_PATH = Path("deepinfer", "protos")
"""Where this folder sits below the include root (its installed package path)."""


def proto_files() -> list[Path]:
    """The `.proto` sources, sorted by name."""
    return sorted(PROTOS_DIR.glob("*.proto"))


def generate(out_dir: Path = PROTOS_DIR) -> list[Path]:
    """Generate the stubs of every proto into `out_dir` (default: this folder); returns the written
    files, sorted.

    Raises RuntimeError with protoc's exit code when protoc fails (its messages go to stderr).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with include_root() as include, tempfile.TemporaryDirectory() as gen_root:
        (Path(gen_root) / PACKAGE_PATH).mkdir(parents=True)
        _protoc(include, Path(gen_root))
        for p in (Path(gen_root) / PACKAGE_PATH).iterdir():
            shutil.copyfile(p, out_dir / p.name)
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


@contextlib.contextmanager
def include_root() -> Iterator[Path]:
    """A temporary include root where this folder appears as `deepinfer/protos/` (a symlink)."""
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp, PACKAGE_PATH)
        link.parent.mkdir(parents=True)
        link.symlink_to(PROTOS_DIR, target_is_directory=True)
        yield Path(tmp)


def proto_sources() -> list[str]:
    """The protos' paths as protoc sees them below `include_root()` (`deepinfer/protos/NAME.proto`)."""
    return [str(PACKAGE_PATH / p.name) for p in proto_files()]


def _protoc(include: Path, out_root: Path) -> None:
    """Blocks while protoc writes the stubs of every proto (seen under `include`) below `out_root`."""
    sources = proto_sources()
    # NOTE: protoc runs in a child process. Loading grpc_tools' bundled protobuf C++ into a process
    # that already holds torch (and other native libraries) crashed with a segmentation fault in CI.
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--proto_path={include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    code = subprocess.run(args, check=False, cwd=include).returncode
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} on {sources}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=PROTOS_DIR, help="output folder of the stubs (default: this folder)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
