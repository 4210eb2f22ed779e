"""Files shipped with specray (prompts, the bundled drafts, the measured drafter record). No
torch here: the Serve controller reads the record while it builds the app."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def measured_drafts_file() -> Path:
    """``specray bench --drafters all --record``'s record: the fastest drafter measured for a
    target, and that target's digest."""
    return Path(str(resources.files("specray.data").joinpath("drafters.json")))
