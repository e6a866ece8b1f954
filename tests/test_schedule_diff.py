"""scripts/schedule_diff.py names the first module whose output for the suffix differs between one forward over
prefix + suffix and the manifest's two-step schedule (issue #13's diagnostic), on the embedded model."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

from kvgraft_cli.config.profiles import environ_without_pins


def test_schedule_diff_names_the_first_differing_module():
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "schedule_diff.py"),
            "--prefix-tokens",
            "179",
            "--suffix-tokens",
            "121",
        ],
        capture_output=True,
        text=True,
        env=environ_without_pins(),
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    first = [line for line in lines if line.startswith("FIRST DIFFERENCE: ")]
    # Under the portable profile a linear layer's rows depend on how many rows it computes together: the first
    # module to differ is a projection, and the logits differ by the README's figure's order of magnitude.
    assert len(first) == 1 and "proj" in first[0].split()[2], p.stdout
    assert lines[-1].startswith("suffix logits: max |diff| ") and "e-0" in lines[-1], p.stdout
