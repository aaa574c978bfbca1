"""Fetch the JavaScript the standalone HTML report inlines, from the npm registry, into
``qreport_widgets/widgets/static/`` (gzipped; the HTML carries them base64-encoded and a few lines
of the page's own script unpack them in the browser).

    python tools/vendor_javascript.py

Needs ``npm`` and the registry. The files are committed: installing or using the package needs
neither. bqplot's and bqscales' JavaScript are not vendored: they come from the installed wheels
(``share/jupyter/nbextensions``), so they always match the Python packages drawing the figures.
"""

from __future__ import annotations

import gzip
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

STATIC = Path(__file__).resolve().parents[1] / "qreport_widgets" / "widgets" / "static"
# package, version, file in the package, name written here
FILES = [
    ("@jupyter-widgets/html-manager", "1.0.15", "package/dist/embed-amd.js", "embed-amd.js.gz"),
    ("requirejs", "2.3.7", "package/require.js", "require.js.gz"),
]


def main() -> None:
    STATIC.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for package, version, member, name in FILES:
            packed = subprocess.run(
                ["npm", "pack", f"{package}@{version}", "--pack-destination", scratch], check=True, capture_output=True, text=True
            ).stdout.split()[-1]
            with tarfile.open(Path(scratch) / packed) as archive:
                text = archive.extractfile(member).read().decode()  # type: ignore[union-attr]
            # source maps are not shipped; a browser's developer tools would ask for them
            text = "\n".join(line for line in text.splitlines() if not line.startswith("//# sourceMappingURL="))
            (STATIC / name).write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
            print(f"{package}@{version}: {len(text):,} bytes -> {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
