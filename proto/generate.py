"""Generate the Python protobuf/gRPC code for proto/kvferry/v1/*.proto into the `kvferry.v1` package.

Run by the install (setup.py's build_py) and usable by hand: `python proto/generate.py`.
The output (kvferry/v1/*_pb2*.py) is generated, never edited, and not committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_root: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc  # build-time dependency (pyproject build-system.requires)

    sources = sorted(PROTO_ROOT.glob("kvferry/v1/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *map(str, sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[s.name for s in sources]}")
    package = out_root / "kvferry" / "v1"
    init = package / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf/gRPC code for the kvferry.v1 API (see proto/)."""\n')
    return sorted(package.glob("*_pb2*.py"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
    sys.exit(0)
