"""The one place that knows the OCI builders: ``docker``, ``podman`` or ``buildah``, whichever this machine has.

push-image builds and pushes through it, and the image smoke test (``infra/cli/smoke.py``) builds, runs and
signals containers through it. The three take the same Dockerfile; they differ in how a container is run:

- docker / podman: ``run --rm`` with bind mounts; a signal goes to the container's PID 1 (``kill --signal``).
- buildah: no daemon and no ``run`` of an image; a working container is made with ``buildah from``, the command
  runs in it with ``buildah run --isolation chroot`` (root, no user namespace: what buildah documents for
  running inside an unprivileged VM or container) with the host's UTS namespace, and the container is removed
  afterwards. Chroot isolation has
  no PID namespace, so a signal goes to the command's own process, the child of ``buildah run``.

Digests: ``buildah push --digestfile`` / ``podman push --digestfile`` write the manifest digest the registry
stored; ``docker push`` prints it (``<tag>: digest: sha256:... size: N``). Sources: buildah-push(1),
buildah-run(1), podman-push(1), the Docker CLI reference for ``docker push``.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from infra.cli.session import CliError

KINDS = ("docker", "podman", "buildah")
_DIGEST = re.compile(r"digest: (sha256:[0-9a-f]{64})")


@dataclass(frozen=True)
class Mount:
    """A bind mount: ``host`` path (absolute) at ``target`` inside the container, read-only unless ``rw``."""

    host: str
    target: str
    rw: bool = False

    def arg(self) -> str:
        return f"{self.host}:{self.target}:{'rw' if self.rw else 'ro'}"


@dataclass
class Container:
    """A running command inside an image (:meth:`Builder.start`); ``proc`` is the local client process."""

    builder: Builder
    name: str
    proc: subprocess.Popen
    cleanup: list[list[str]] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the command (docker/podman: the container's PID 1; buildah: the child of ``buildah
        run``, which chroot isolation runs in the host's PID namespace)."""
        if self.builder.kind == "buildah":
            import psutil

            # buildah run -> buildah-chroot-runtime -> buildah-chroot-exec -> the command
            execs = [
                p
                for p in psutil.Process(self.proc.pid).children(recursive=True)
                if _first_arg(p) == "buildah-chroot-exec"
            ]
            commands = [c for p in execs for c in p.children()]
            if not commands:
                raise CliError(f"container {self.name}: its command is not running (exit {self.proc.poll()})")
            for command in commands:
                command.send_signal(sig)
        else:
            subprocess.run([self.builder.binary, "kill", "--signal", str(int(sig)), self.name], check=False)

    def stop(self) -> None:
        """Kills the command when it still runs, then removes the working container and the host folders made
        for it (a no-op for a command :meth:`wait` has seen end)."""
        if self.proc.poll() is None:
            try:
                self.signal(signal.SIGKILL)
            except CliError:
                pass
            self.proc.kill()
        self.wait()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Exit status of the command (waits up to ``timeout`` s), then removes the working container and the
        host folders made for it."""
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is not None:
                _clean(self.cleanup, self.folders)


@dataclass(frozen=True)
class Builder:
    """One OCI builder: ``kind`` (docker, podman or buildah) and the ``binary`` to run."""

    kind: str
    binary: str

    def _run(self, args: Sequence[str], *, input_text: Optional[str] = None, quiet: bool = False, cwd=None) -> str:
        """Runs the builder with ``args``; returns stdout. Raises CliError naming the command on failure."""
        cmd = [self.binary, *args]
        try:
            proc = subprocess.run(
                cmd,
                cwd=cwd,
                input=input_text,
                text=True,
                stdout=subprocess.PIPE if quiet or input_text is not None else None,
                stderr=subprocess.PIPE if quiet or input_text is not None else None,
            )
        except FileNotFoundError:
            raise CliError(
                f"{self.binary!r} not found", "install docker, podman or buildah, or pass --builder PATH"
            ) from None
        if proc.returncode != 0:
            shown = " ".join(cmd[:3])
            said = (proc.stderr or "").strip()[-500:] or "its messages are above"
            raise CliError(f"`{shown} ...` failed with exit {proc.returncode}: {said}")
        return proc.stdout or ""

    def storage_root(self) -> str:
        """The folder where the builder keeps image layers (docker's DockerRootDir, podman's and buildah's
        GraphRoot). Raises CliError when the builder cannot say."""
        fmt = {"docker": "{{.DockerRootDir}}", "podman": "{{.Store.GraphRoot}}"}.get(self.kind, "{{.store.GraphRoot}}")
        return self._run(["info", "--format", fmt], quiet=True).strip()

    def login(self, registry: str, user: str, password: str, tls_verify: bool = True) -> None:
        """``login --username USER --password-stdin REGISTRY`` (the password never on the command line)."""
        extra = [] if tls_verify or self.kind == "docker" else ["--tls-verify=false"]
        self._run(["login", "--username", user, "--password-stdin", *extra, registry], input_text=password)

    def build(
        self,
        context: Path,
        dockerfile: str,
        tag: str,
        build_args: Optional[dict[str, str]] = None,
        mounts: Sequence[Mount] = (),
    ) -> None:
        """Builds ``dockerfile`` (relative to ``context``) as ``tag`` with layer caching; a failed build leaves
        no working container behind. ``mounts`` are bind mounts for the RUN steps only (buildah/podman
        ``--volume``; docker has none and refuses them)."""
        args = ["build", "-f", dockerfile, "-t", tag]
        for key, value in (build_args or {}).items():
            args += ["--build-arg", f"{key}={value}"]
        if self.kind != "docker":  # Docker's image format: OCI's has no SHELL, and the Dockerfile sets one;
            # --force-rm: the working container of a failed step is removed too (buildah-bud(1), podman-build(1))
            args[1:1] = ["--format", "docker", "--force-rm"]
        if self.kind == "buildah":
            args[0:1] = ["bud", "--layers", "--isolation", "chroot"]
        if mounts:
            if self.kind == "docker":
                raise CliError("docker build takes no build-time bind mounts", "use podman or buildah")
            for m in mounts:
                args += ["--volume", m.arg()]
        self._run([*args, "."], cwd=context)

    def pull(self, image: str) -> None:
        """Pulls ``image`` into the local store (a logged-in builder for a private registry). Raises CliError."""
        self._run(["pull", image], quiet=True)

    def push(self, image: str, tls_verify: bool = True, dest: Optional[str] = None) -> str:
        """Pushes ``image`` (``registry/repository:tag``), or the local ``image`` as ``dest`` when given; returns
        the manifest digest the registry stored (``sha256:...``). The layers are compressed at push time with the
        builder's defaults, the same for every push of one image, so two registries store the same digest.
        Raises CliError when the push fails or no digest comes back."""
        if dest and self.kind == "docker":
            self._run(["tag", image, dest], quiet=True)
            image, dest = dest, None
        if self.kind == "docker":
            out = self._run(["push", image], quiet=True)
            print(out, end="")
            found = _DIGEST.findall(out)
            if not found:
                raise CliError(f"`docker push {image}` printed no digest line: {out[-300:]!r}")
            return found[-1]
        with tempfile.TemporaryDirectory() as tmp:
            digest_file = Path(tmp) / "digest"
            extra = [] if tls_verify else ["--tls-verify=false"]
            target = [f"docker://{dest or image}"] if self.kind == "buildah" or dest else []
            self._run(["push", "--digestfile", str(digest_file), *extra, image, *target])
            return digest_file.read_text().strip()

    def exists(self, image: str) -> bool:
        """Whether ``image`` is in the local store."""
        args = ["inspect", "--type", "image", image] if self.kind == "buildah" else ["image", "inspect", image]
        return subprocess.run([self.binary, *args], capture_output=True).returncode == 0

    def image_digest(self, image: str) -> str:
        """The local image's identity: the manifest digest (buildah, podman) or the image ID (docker, which has
        a manifest digest only once pushed)."""
        if self.kind == "buildah":
            return self._run(
                ["inspect", "--type", "image", "--format", "{{.FromImageDigest}}", image], quiet=True
            ).strip()
        fmt = "{{.Id}}" if self.kind == "docker" else "{{.Digest}}"
        out = self._run(["image", "inspect", "--format", fmt, image], quiet=True).strip()
        return out if out.startswith("sha256:") else f"sha256:{out}"

    def _buildah_config(self, image: str) -> dict:
        """The OCI image configuration of a local image (``buildah inspect``'s ``OCIv1.config``; buildah 1.28's
        ``--format`` has no json function, so the whole record is read)."""
        record = json.loads(self._run(["inspect", "--type", "image", image], quiet=True) or "{}")
        return (record.get("OCIv1") or {}).get("config") or {}

    def image_labels(self, image: str) -> dict[str, str]:
        """The labels of the local ``image``'s configuration (``{}`` when it has none)."""
        if self.kind == "buildah":
            return self._buildah_config(image).get("Labels") or {}
        out = self._run(["image", "inspect", "--format", "{{json .Config.Labels}}", image], quiet=True)
        return json.loads(out or "null") or {}

    def image_size(self, image: str) -> int:
        """Size of ``image`` in bytes, as the builder reports it (the layers' uncompressed size)."""
        if self.kind == "buildah":  # buildah reports it rounded, in decimal units (go-units HumanSize)
            out = self._run(["images", "--format", "{{.Size}}", image], quiet=True).strip().splitlines()[0]
            match = re.fullmatch(r"([\d.]+)\s*([kMGT]?B)", out)
            if not match:
                raise CliError(f"buildah images: unexpected size {out!r} of {image}")
            return round(float(match.group(1)) * 1000 ** "BkMGT".index(match.group(2)[0]))
        return int(self._run(["image", "inspect", "--format", "{{.Size}}", image], quiet=True).strip())

    def import_rootfs(self, tarball: Path, image: str) -> None:
        """A one-layer image ``image`` from a root file system ``tarball`` (e.g. mmdebstrap's output)."""
        if self.kind == "buildah":
            ctr = self._run(["from", "scratch"], quiet=True).strip()
            try:
                self._run(["add", ctr, str(tarball), "/"], quiet=True)
                self._run(["commit", "--quiet", ctr, image], quiet=True)
            finally:
                subprocess.run([self.binary, "rm", ctr], capture_output=True)
        else:
            self._run(["import", str(tarball), image], quiet=True)

    def start(
        self,
        image: str,
        argv: Sequence[str],
        mounts: Sequence[Mount] = (),
        env: Optional[dict[str, str]] = None,
        stdout=None,
        hosts: Optional[dict[str, str]] = None,
    ) -> Container:
        """Runs ``argv`` in a fresh container of ``image`` as ``docker run IMAGE argv`` does (its ENV, WORKDIR and
        PATH, and its ENTRYPOINT in front of ``argv``: buildah run does not apply it, so it is read from the image)
        and returns at once. ``stdout``: as subprocess.Popen's (stderr joins it). ``hosts``: extra name -> address
        entries of the container's /etc/hosts (docker/podman ``--add-host``; buildah: a hosts file of its own
        mounted over /etc/hosts with ``--no-hosts``, since buildah writes its own over any other mount)."""
        name = f"trainstack-{uuid.uuid4().hex[:12]}"
        env_args = [a for k, v in (env or {}).items() for a in ("--env", f"{k}={v}")]
        vol_args = [a for m in mounts for a in ("--volume", m.arg())]
        host_args = [f"--add-host={name}:{ip}" for name, ip in (hosts or {}).items()]
        if self.kind != "buildah":
            cmd = [self.binary, "run", "--rm", "--name", name, "--ipc", "host", *env_args, *vol_args, *host_args]
            proc = subprocess.Popen(
                [*cmd, image, *argv], stdout=stdout, stderr=subprocess.STDOUT if stdout else None, text=True
            )
            return Container(self, name, proc)
        folders: list[str] = []
        if hosts:
            folders.append(tempfile.mkdtemp(prefix="trainstack-hosts-"))
            table = Path(folders[0]) / "hosts"
            lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{ip} {name}" for name, ip in hosts.items()]
            table.write_text("\n".join(lines) + "\n")
            host_args = ["--no-hosts", "--volume", Mount(str(table), "/etc/hosts").arg()]
        cleanup: list[list[str]] = []
        try:
            self._run(["from", "--pull-never", "--name", name, image], quiet=True)
            cleanup.append([self.binary, "rm", name])
            entrypoint = self._buildah_config(image).get("Entrypoint")
            # --uts host: buildah names the container's host after its id but leaves it out of /etc/hosts, and
            # torchrun's rendezvous resolves the host name (it waited on DNS until killed)
            cmd = [self.binary, "run", "--isolation", "chroot", "--uts", "host", *env_args, *vol_args, *host_args]
            cmd += [name, "--", *(entrypoint or []), *argv]
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout else None, text=True)
        except BaseException:
            _clean(cleanup, folders)
            raise
        return Container(self, name, proc, cleanup, folders)

    def real_files(self, image: str, paths: Sequence[str]) -> list[str]:
        """Of ``paths`` (absolute, inside ``image``), the regular files there, each as the path it resolves to
        inside the image (symbolic links followed, once per file), in the order given. Runs ``sh`` in a
        throw-away container of the local ``image`` without its entrypoint. Raises CliError when it cannot."""
        script = 'for f in "$@"; do [ -f "$f" ] && readlink -f "$f"; done; true'
        if self.kind == "buildah":
            name = f"trainstack-probe-{uuid.uuid4().hex[:12]}"
            self._run(["from", "--pull-never", "--name", name, image], quiet=True)
            try:
                out = self._run(
                    ["run", "--isolation", "chroot", name, "--", "sh", "-c", script, "sh", *paths], quiet=True
                )
            finally:
                subprocess.run([self.binary, "rm", name], capture_output=True)
        else:
            out = self._run(["run", "--rm", "--entrypoint", "sh", image, "-c", script, "sh", *paths], quiet=True)
        return list(dict.fromkeys(line.strip() for line in out.splitlines() if line.strip().startswith("/")))


# Where OpenSSL, and so pip (which trusts the system's store through truststore since pip 24.2: pip docs, "HTTPS
# Certificates"), reads the CA bundle by default: Debian/Ubuntu /usr/lib/ssl/cert.pem -> this file; Amazon Linux
# 2023 (OPENSSLDIR /etc/pki/tls) cert.pem and certs/ca-bundle.crt -> /etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem
CA_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/cert.pem", "/etc/pki/tls/certs/ca-bundle.crt")


def _clean(commands: list[list[str]], folders: list[str]) -> None:
    for cmd in commands:
        subprocess.run(cmd, check=False, capture_output=True)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def ca_mounts(b: Builder, bundle: Optional[str], image: str) -> list[Mount]:
    """The build-time mounts of the CA file ``bundle`` over the CA bundle that the OpenSSL of ``image`` (the
    build's FROM) reads by default (:data:`CA_FILES`, resolved inside the image: Debian's, Amazon Linux's), so
    that pip in the RUN steps trusts a TLS-inspecting proxy without any setting in the image, and nothing of
    it stays in a layer. None without ``bundle``, for docker (no build-time mounts) or FROM ``scratch``. Raises
    CliError when ``image`` has none of those files, or cannot be run to look."""
    if not bundle or b.kind == "docker" or image == "scratch":
        return []
    targets = b.real_files(image, CA_FILES)
    if not targets:
        raise CliError(f"--ca-bundle: {image} has none of {', '.join(CA_FILES)} to mount it over")
    return [Mount(str(Path(bundle).resolve()), target) for target in targets]


def _first_arg(process) -> str:
    try:
        return (process.cmdline() or [""])[0]
    except Exception:  # the process ended meanwhile (psutil.NoSuchProcess) or is not ours to read
        return ""


def _engine_answers(binary: str) -> bool:
    """docker's CLI can be present without a reachable engine (as on this project's dev box)."""
    try:
        return subprocess.run([binary, "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def kind_of(binary: str) -> str:
    """docker, podman or buildah: what ``binary --version`` says it is (``Docker version 28.2.2, build ...``,
    ``podman version 5.4.2``, ``buildah version 1.28.2 (...)``), whatever its file name. Raises CliError (exit 2)
    for a binary that does not answer so (``/bin/true`` prints nothing)."""
    try:
        said = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        said = f"({type(e).__name__})"
    match = re.match(r"(docker|podman|buildah) version \d", said, re.I)
    if not match:
        raise CliError(
            f"--builder {binary}: not an OCI builder (`--version` printed {(said.splitlines() or [''])[0][:80]!r}); "
            "expected a docker, podman or buildah binary"
        )
    return match.group(1).lower()


def find(binary: Optional[str] = None) -> Builder:
    """The builder to use: ``binary`` when given (its kind from its ``--version``: :func:`kind_of`), else the
    first of docker (when its engine answers ``docker info``), podman, buildah on PATH.
    Raises CliError with the install step when there is none, or when ``binary`` is not a builder."""
    if binary:
        if not shutil.which(binary):
            raise CliError(f"--builder {binary}: not an executable; expected a docker, podman or buildah binary")
        return Builder(kind_of(binary), binary)
    for kind in KINDS:
        found = shutil.which(kind)
        if found and (kind != "docker" or _engine_answers(found)):
            return Builder(kind, found)
    raise CliError(
        "no OCI builder: neither a docker engine, podman nor buildah was found",
        "install one (Debian: `apt-get install buildah`, what `make image-smoke` does as root), or pass --builder PATH",
    )
