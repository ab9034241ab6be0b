"""Import the e2e node's images into its cached containerd store ahead of the node tests.

`make test` runs this at the lowest CPU priority while the other e2e tests run, so
`e2e/test_node_*.py` start their node with every image already imported (the import of the
4 GB engine image takes minutes). Needs root; nothing but containerd is started.

    cd e2e && python -m k8s.preload
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from k8s.node import LocalNode


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="servefleet-preload-") as run_dir:
        # containerd and images.sh only: no Kubernetes binary is started
        node = LocalNode(bin_dir=Path(run_dir), run_dir=Path(run_dir))
        node.import_images()
    print(f"preload: {node.images} imported in {node.timings.get('images')} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
