"""natsim.gpus: the GPUs with coefficient files, read without torch, are the planner's `known_gpus` wherever the
files load as cost models, and natsim's own files are where the planner keeps them."""

from __future__ import annotations

import json
import shutil

from natsim.gpus import coefficient_gpus, shipped_coefficients_dir
from natsim.planner.cost import COEFFICIENTS_DIR, known_gpus, user_coefficients_dir
from natsim.stored import LINKS_DIR


def test_natsims_own_files_are_the_planners():
    assert shipped_coefficients_dir().resolve() == COEFFICIENTS_DIR.resolve()
    assert coefficient_gpus() == known_gpus() and "NVIDIA H200" in coefficient_gpus()


def test_the_users_files_are_listed_as_the_planner_lists_them():
    """A GPU calibrated here is listed; a file not named after its GPU, one that is not JSON, an interconnect
    file and one without a GPU are passed over (the autouse fixture points the user's folder at an empty one)."""
    folder = user_coefficients_dir()
    folder.mkdir(parents=True, exist_ok=True)
    model = json.loads((COEFFICIENTS_DIR / "nvidia-h200.json").read_text())
    (folder / "nvidia-a100-sxm4-80gb.json").write_text(json.dumps({**model, "gpu": "NVIDIA A100-SXM4-80GB"}))
    (folder / "renamed.json").write_text(json.dumps({**model, "gpu": "NVIDIA L40S"}))
    (folder / "broken.json").write_text("{not json")
    (folder / "no-gpu.json").write_text(json.dumps({"format": 1}))
    shutil.copy(LINKS_DIR / "link-nvidia-h200-x2.json", folder)
    assert coefficient_gpus() == known_gpus()
    assert "NVIDIA A100-SXM4-80GB" in coefficient_gpus() and "NVIDIA L40S" not in coefficient_gpus()
