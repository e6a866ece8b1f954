"""Compare the fingerprints of two `kvgraft matrix --json` runs made on different machines.

A cell's fingerprint is the SHA-256 over its fresh logits hashes; a profile is portable between two machines when
every one of its cells has the same fingerprint on both (same torch and transformers versions: they are pinned).
Usage:
    kvgraft matrix --json > here.json          # on each machine, same options
    python scripts/portability.py here.json there.json
Exit status 1 when a portable-profile cell differs.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    runs = []
    for name in sys.argv[1:]:
        with open(name, encoding="utf-8") as f:
            runs.append(
                {(c["arch"], c["dtype"], c["profile"], c["device"], c["attn"]): c for c in json.load(f)["cells"]}
            )
    a, b = runs
    common = sorted(set(a) & set(b))
    per_profile: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key in common:
        if a[key]["unsupported"] or b[key]["unsupported"]:
            continue
        same = a[key]["fingerprint"] == b[key]["fingerprint"]
        per_profile[key[2]][0] += same
        per_profile[key[2]][1] += 1
        print(
            f"{key[0]:>8} {key[1]:>9} {key[2]:>9}  {'same' if same else 'DIFFERENT':>9}  "
            f"{a[key]['fingerprint'][:16]} {b[key]['fingerprint'][:16]}"
        )
    print()
    for prof, (same, n) in sorted(per_profile.items()):
        print(f"{prof}: {same}/{n} cells with the same fingerprint on both machines")
    portable = per_profile.get("portable")
    sys.exit(1 if portable and portable[0] != portable[1] else 0)


if __name__ == "__main__":
    main()
