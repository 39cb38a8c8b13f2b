"""Progress bars on stderr (tqdm) for the long start-up steps: loading or generating weights and
writing a checkpoint. Shown when stderr is a terminal; ``TIDAL_PROGRESS=1`` forces them on (logs of
a container), ``TIDAL_PROGRESS=0`` off."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it",
             show: bool = True):
    from tqdm import tqdm

    mode = os.environ.get("TIDAL_PROGRESS")
    on = mode == "1" if mode in ("0", "1") else sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not (on and show), file=sys.stderr,
                mininterval=0.5, dynamic_ncols=True)
