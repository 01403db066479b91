"""A distribution registry (Debian's ``docker-registry``) serving on 127.0.0.1 from a folder: where
``make image-smoke`` pushes the image it tested, so the digest it prints is the manifest digest a registry stores
for that image (the one push-image prints for the same build), and where the push-image tests push.

Nothing leaves 127.0.0.1. Source: the distribution registry's configuration reference (``version``, ``storage.
filesystem.rootdirectory``, ``http.addr``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from infra.cli.session import CliError


@contextlib.contextmanager
def local_registry(folder: Path, timeout_s: float = 30.0) -> Iterator[str]:
    """Serves a registry from ``folder`` (its blobs under ``folder/registry``, its log in ``folder/registry.log``)
    on a free port of 127.0.0.1 and yields ``127.0.0.1:PORT`` (plain HTTP: push with TLS verification off); stops
    it on exit. Raises CliError when ``docker-registry`` is missing or does not answer ``/v2/`` within
    ``timeout_s`` seconds (the message ends with its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "registry.yml"
    config.write_text(
        json.dumps(
            {
                "version": 0.1,
                "log": {"level": "warn"},
                "storage": {"filesystem": {"rootdirectory": str(folder / "registry")}},
                "http": {"addr": f"127.0.0.1:{port}"},
            }
        )
    )
    log_path = folder / "registry.log"
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
        except FileNotFoundError:
            raise CliError(
                "docker-registry not found", "as root: apt-get install docker-registry (make image-tools)"
            ) from None
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise CliError(f"the local registry did not start: {log_path.read_text()[-500:]}") from None
                    time.sleep(0.2)
            yield f"127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)
