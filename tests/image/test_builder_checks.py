"""infra/cli/builder.py: a --builder is what its ``--version`` says (``/bin/true`` is refused), the CA bundle is
mounted where the base's OpenSSL reads it (Debian's and Amazon Linux's layouts), and a build or a container that
fails leaves nothing behind (``--force-rm``; the hosts folder and the working container removed)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from infra.cli import builder as oci
from infra.cli.session import CliError


def _fake(tmp_path: Path, name: str, body: str) -> Path:
    """A builder binary ``name`` in ``tmp_path`` that records its argv (JSON lines in calls.jsonl) and runs
    ``body`` (Python, with ``args`` = its argv)."""
    fake = tmp_path / name
    calls = tmp_path / "calls.jsonl"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, subprocess, sys\nargs = sys.argv[1:]\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(args) + '\\n')\n{body}\n"
    )
    fake.chmod(0o755)
    return fake


def _calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_binary_that_does_not_answer_like_a_builder_is_refused():
    with pytest.raises(
        CliError, match=r"^--builder /bin/true: not an OCI builder \(`--version` printed '[^\n]*'\); expected a docker"
    ) as e:
        oci.find("/bin/true")
    assert e.value.code == 2 and "\n" not in str(e.value)


def test_the_kind_comes_from_the_version_line_not_the_file_name(tmp_path):
    fake = _fake(tmp_path, "my-builder", "print('podman version 5.4.2')")
    assert oci.find(str(fake)) == oci.Builder("podman", str(fake))
    fake = _fake(tmp_path, "docker", "print('buildah version 1.28.2 (image-spec 1.1.0-rc2, runtime-spec 1.0.2-dev)')")
    assert oci.find(str(fake)).kind == "buildah"


# The fake buildah runs the probe's `sh -c SCRIPT sh PATHS` on this machine with every path under a fake root
PROBE = """
root = os.environ["FAKE_ROOT"]
if args[0] == "run":
    script, paths = args[args.index("-c") + 1], args[args.index("-c") + 3 :]
    out = subprocess.run(["sh", "-c", script, "sh", *[root + p for p in paths]], capture_output=True, text=True)
    print(out.stdout.replace(root, ""), end="")
elif args[0] == "from":
    print(args[-2])
"""


def _layout(root: Path, files: dict[str, str]) -> None:
    """``files``: path -> "file" or the target of a (relative) symbolic link."""
    for rel, what in files.items():
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if what == "file":
            path.write_text("the base's CAs\n")
        else:
            path.symlink_to(what)


@pytest.mark.parametrize(
    "layout,targets",
    [
        (  # Amazon Linux 2023 (the DLC): OpenSSL's cert.pem and the compat bundle both lead to one extracted file
            {
                "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem": "file",
                "/etc/pki/tls/cert.pem": "../ca-trust/extracted/pem/tls-ca-bundle.pem",
                "/etc/pki/tls/certs/ca-bundle.crt": "../../ca-trust/extracted/pem/tls-ca-bundle.pem",
                "/etc/ssl/certs": "../pki/tls/certs",
            },
            ["/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem"],
        ),
        ({"/etc/ssl/certs/ca-certificates.crt": "file"}, ["/etc/ssl/certs/ca-certificates.crt"]),  # Debian (stand-in)
    ],
    ids=["amazon-linux-2023", "debian"],
)
def test_the_ca_bundle_is_mounted_over_the_file_the_bases_openssl_reads(tmp_path, monkeypatch, layout, targets):
    """Without PIP_CERT pip trusts OpenSSL's default file (truststore); on Amazon Linux that is /etc/pki/tls/
    cert.pem -> tls-ca-bundle.pem, where a mount over Debian's path would go unread."""
    root = tmp_path / "root"
    _layout(root, layout)
    monkeypatch.setenv("FAKE_ROOT", str(root))
    b = oci.Builder("buildah", str(_fake(tmp_path, "buildah", PROBE)))
    bundle = tmp_path / "proxy-ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    assert oci.ca_mounts(b, str(bundle), "base:1") == [oci.Mount(str(bundle), t) for t in targets]
    assert [c[0] for c in _calls(tmp_path)] == ["from", "run", "rm"]  # the probe's container is removed


def test_a_base_without_a_ca_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "root").mkdir()
    monkeypatch.setenv("FAKE_ROOT", str(tmp_path / "root"))
    b = oci.Builder("buildah", str(_fake(tmp_path, "buildah", PROBE)))
    with pytest.raises(CliError, match="base:1 has none of /etc/ssl/certs/ca-certificates.crt"):
        oci.ca_mounts(b, str(tmp_path / "ca.pem"), "base:1")
    assert oci.ca_mounts(oci.Builder("docker", "docker"), str(tmp_path / "ca.pem"), "base:1") == []


def test_a_failed_buildah_build_removes_its_working_containers(tmp_path):
    b = oci.Builder("buildah", str(_fake(tmp_path, "buildah", "sys.exit(1)")))
    with pytest.raises(CliError, match="failed with exit 1: its messages are above"):
        b.build(tmp_path, "Dockerfile", "img:1")
    (build,) = _calls(tmp_path)
    assert build[0] == "bud" and "--force-rm" in build


def test_a_container_that_cannot_start_leaves_no_container_or_hosts_folder(tmp_path, monkeypatch):
    """buildah: the working container is made, then reading the image's entrypoint fails: it is removed, and
    the hosts file's temporary folder with it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    b = oci.Builder("buildah", str(_fake(tmp_path, "buildah", "sys.exit(3 if args[0] == 'inspect' else 0)")))
    with pytest.raises(CliError, match="exit 3"):
        b.start("img:1", ["train"], hosts={"algo-1": "127.0.0.1"})
    assert [c[0] for c in _calls(tmp_path)] == ["from", "inspect", "rm"]
    assert os.listdir(tmp_path / "tmp") == []


def test_a_finished_container_removes_its_hosts_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    body = "if args[0] == 'inspect': print(json.dumps({'OCIv1': {'config': {}}}))"
    b = oci.Builder("buildah", str(_fake(tmp_path, "buildah", body)))
    c = b.start("img:1", ["train"], hosts={"algo-1": "127.0.0.1"})
    assert len(os.listdir(tmp_path / "tmp")) == 1
    assert c.wait(timeout=30) == 0
    c.stop()  # a second clean-up is harmless
    assert os.listdir(tmp_path / "tmp") == [] and _calls(tmp_path)[-1][0] == "rm"
