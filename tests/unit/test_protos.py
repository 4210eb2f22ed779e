"""The generated Python stubs in specray/v1/ are committed; this fails when they are stale.

Regenerate with:
    python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. \
        protos/specray/v1/*.proto
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_protos(tmp_path):
    protos = sorted((ROOT / "protos" / "specray" / "v1").glob("*.proto"))
    assert protos
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *map(str, protos),
        ],
        check=True,
    )
    generated = sorted((tmp_path / "specray" / "v1").iterdir())
    assert generated
    for fresh in generated:
        committed = ROOT / "specray" / "v1" / fresh.name
        assert committed.exists(), f"{committed} is missing: regenerate the stubs"
        assert committed.read_bytes() == fresh.read_bytes(), f"{committed} is stale"
