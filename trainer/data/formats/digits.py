"""The embedded default dataset: scikit-learn's bundled handwritten-digit scans as an ImageFolder.

``sklearn.datasets.load_digits`` ships 1,797 real 8x8 grey-level scans of digits 0-9 (UCI "Optical
Recognition of Handwritten Digits", 43 writers) inside the wheel, so it is available offline on any machine.
They are written once as PNG files into ``<cache>/digits-v1/{train,val}/<digit>/<n>.png`` (every 5th scan
goes to val: 1,437 train, 360 val) so that the same ImageFolder path the real runs use is exercised.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """``$TRAINSTACK_CACHE``, else ``$XDG_CACHE_HOME/trainstack``, else ``~/.cache/trainstack``."""
    if os.environ.get("TRAINSTACK_CACHE"):
        return Path(os.environ["TRAINSTACK_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainstack"


def ensure_digits(root: Path | None = None) -> Path:
    """Write the digits ImageFolder if it is not there yet and return its root.

    Safe when several ranks call it at once: each writes a private temporary folder and renames it into
    place; a rank that loses the race discards its copy.
    """
    target = (root or cache_root()) / "digits-v1"
    if (target / "val").is_dir():
        return target
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".digits-", dir=target.parent))
    try:
        d = load_digits()
        for i, (img, label) in enumerate(zip(d.images, d.target)):
            split = "val" if i % 5 == 0 else "train"
            out = tmp / split / str(int(label))
            out.mkdir(parents=True, exist_ok=True)
            pixels = np.clip(img * (255.0 / 16.0), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(out / f"{i:04d}.png")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "val").is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
