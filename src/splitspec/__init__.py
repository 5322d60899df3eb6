"""splitspec: a 2-bit base on the GPU, the residual on the CPU, tree speculative decoding."""

import hashlib
import os
import sys
from pathlib import Path

__version__ = "0.1.0"


def _kernel_cache() -> None:
    """Point numba's cache at a folder named by a hash of every kernel source, unless NUMBA_CACHE_DIR is set.

    numba checks only the file of the function it compiles, not the intrinsics and helpers it inlines from
    other modules: after an edit or an upgrade that touches only those (``cpu_base/nibbles.py`` under
    ``rows.py``, say), the cache in ``__pycache__`` would hand back the old machine code. The CPU actor
    processes this one starts import splitspec too, and find the same folder."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    from splitspec.config import _cache_root

    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("kernels/**/*.py"), *root.glob("gpu_actor/kernels/**/*.py")]):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    folder = str(_cache_root() / "numba" / digest.hexdigest()[:16])
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return  # not writable here: numba's own places, as before
    if "numba" in sys.modules:
        # imported first: its config has read the environment already, and a changed NUMBA_* variable would
        # make it re-read all of them (refused once its threads run on a CPU set since narrowed)
        sys.modules["numba"].config.CACHE_DIR = folder
    else:
        os.environ["NUMBA_CACHE_DIR"] = folder


_kernel_cache()
