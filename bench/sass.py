"""Reading `cuobjdump -sass` output: what a compiled kernel does inside its loops."""

from __future__ import annotations

import re


def loop_spills(sass: str) -> int:
    """The local-memory loads and stores (LDL, STL) of `cuobjdump -sass` output that lie inside
    a loop: between a backward branch's target and the branch."""
    code = [
        (int(address, 16), text)
        for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]
    loops = []
    for address, text in code:
        branch = re.search(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            loops.append((int(branch.group(1), 16), address))
    return sum(
        1
        for address, text in code
        if re.search(r"\b(?:LDL|STL)\b", text)
        and any(start <= address <= end for start, end in loops)
    )
