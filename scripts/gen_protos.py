"""Regenerate the Python code beside the .proto sources: `python scripts/gen_protos.py [OUT_DIR]`.

protoc names imports after the proto package (`from coalesce.v1 import x_pb2`); our generated code lives in
the `protos` Python package, so the imports are rewritten to `from protos.coalesce.v1 import x_pb2`.
It also writes `descriptors.binpb`, a FileDescriptorSet with the source comments, which server reflection
serves (the generated modules carry none). The freshness test runs this into a temporary folder and compares.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("coalesce") / "v1"
DESCRIPTOR_SET = "descriptors.binpb"


def generate(out_root: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py for every .proto, and the descriptor set, into out_root/coalesce/v1."""
    sources = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    out_root.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    names = [str(s.relative_to(PROTO_ROOT)) for s in sources]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *names,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    descriptors = out_root / PACKAGE_DIR / DESCRIPTOR_SET
    set_args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", "--include_imports", "--include_source_info",
                f"--descriptor_set_out={descriptors}", *names]  # fmt: skip
    if protoc.main(set_args) != 0:
        raise SystemExit("protoc failed (descriptor set)")
    written = sorted((out_root / PACKAGE_DIR).glob("*_pb2*.py*"))
    for path in written:
        text = re.sub(r"^from coalesce\.v1 import", "from protos.coalesce.v1 import", path.read_text(), flags=re.M)
        path.write_text(text)
    for pkg in (out_root / "coalesce", out_root / PACKAGE_DIR):
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
    return [*written, descriptors]


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
