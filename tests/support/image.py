"""The EPP's image, built from the project's Containerfile and run here without a registry.

- **Storage**: podman's own image store for this checkout under ``build/image-cache/storage``
  (its run state under ``/run``, which a reboot clears), so the tests neither see nor prune
  the machine's images or another checkout's, and the build's layer cache outlives a run.
- **Base**: ``mmdebstrap --variant=minbase`` makes a Debian bookworm root with Python 3.11
  (``python3``, ``python3-venv``), kept as a tarball under ``build/image-cache`` (named by a
  hash of the command, so a second run reuses it) and loaded with ``podman import``.
- **Wheels**: ``make wheels`` (``build/wheels``: the runtime dependencies, resolved again only
  when pyproject.toml changes, and the project's own).
- **Build**: ``podman build --isolation chroot`` with ``BASE_IMAGE`` set to that base, tagged
  ``localhost/epp:test`` (and its first stage ``localhost/epp-build:test``, so that pruning
  what an earlier run left keeps the cache of this one).
- **Run**: ``podman run`` is refused in this sandbox, so the image's root is mounted
  (``podman image mount``) and its entrypoint run there with ``chroot`` as the image's user,
  with the image's environment, in a private mount namespace (``unshare --mount``) holding
  ``/dev`` and ``/proc``: the mounts go away with the process. The process shares the host's
  network, so its ports are on loopback.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.manifests import ROOT

__all__ = ["BASE_PACKAGES", "BuiltImage", "build_image", "image_tools_missing", "run_entrypoint"]

CACHE = ROOT / "build" / "image-cache"
_RUN_STATE = Path("/run") / f"epp-image-test-{hashlib.sha256(bytes(CACHE)).hexdigest()[:12]}"
#: podman on this checkout's own store
PODMAN = (
    "podman",
    "--root",
    str(CACHE / "storage"),
    "--runroot",
    str(_RUN_STATE / "storage"),
    "--tmpdir",
    str(_RUN_STATE / "libpod"),
)
IMAGE = "localhost/epp:test"
BUILD_STAGE = "localhost/epp-build:test"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
_MMDEBSTRAP = (
    "mmdebstrap",
    "--variant=minbase",
    f"--include={','.join(BASE_PACKAGES)}",
    # what a runtime image does not need
    *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "info", "locale")),
    "bookworm",
)


def image_tools_missing() -> list[str]:
    """The commands the image tests need that are not on PATH (``make install`` installs
    them: Debian's podman and mmdebstrap)."""
    tools = ("podman", "mmdebstrap", "unshare", "chroot")
    return [tool for tool in tools if not shutil.which(tool)]


def _run(argv: Sequence[str], *, timeout: float, cwd: Path = ROOT) -> str:
    done = subprocess.run(
        list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:4])} ... exited {done.returncode}:\n{done.stdout[-3000:]}"
            f"\n{done.stderr[-3000:]}"
        )
    return done.stdout


@dataclass
class BuiltImage:
    """A built image: its name, size and how long each step took (seconds)."""

    name: str
    base: str
    size_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)

    def config(self) -> dict[str, object]:
        """The image's ``Config`` (Entrypoint, User, Env, WorkingDir, ...)."""
        out = _run([*PODMAN, "image", "inspect", self.name], timeout=60)
        config: dict[str, object] = json.loads(out)[0]["Config"]
        return config


def _base() -> tuple[str, float]:
    """The local base image (imported when missing) and the seconds it took."""
    started = time.monotonic()
    digest = hashlib.sha256(" ".join(_MMDEBSTRAP).encode()).hexdigest()[:12]
    name = f"localhost/epp-base:{digest}"
    exists = subprocess.run([*PODMAN, "image", "exists", name], check=False).returncode == 0
    if not exists:
        CACHE.mkdir(parents=True, exist_ok=True)
        tarball = CACHE / f"base-{digest}.tar"
        if not tarball.exists():
            partial = CACHE / f"base-{digest}.partial.tar"  # the suffix sets the format
            _run([*_MMDEBSTRAP, str(partial)], timeout=900)
            partial.rename(tarball)
        _run([*PODMAN, "import", str(tarball), name], timeout=300)
    return name, time.monotonic() - started


def _build(base: str, *options: str) -> None:
    _run(
        [
            *PODMAN,
            "build",
            "--isolation",
            "chroot",
            "--build-arg",
            f"BASE_IMAGE={base}",
            *options,
            "-f",
            "Containerfile",
            ".",
        ],
        timeout=900,
    )


def build_image() -> BuiltImage:
    """Builds the Containerfile as ``localhost/epp:test`` on the local base, reusing the
    layers of the last build where its inputs are the same; removes what that left
    behind."""
    base, base_seconds = _base()
    started = time.monotonic()
    _run(["make", "--no-print-directory", "wheels"], timeout=900)
    wheels_seconds = time.monotonic() - started
    started = time.monotonic()
    _build(base, "--target", "build", "-t", BUILD_STAGE)
    _build(base, "-t", IMAGE)
    build_seconds = time.monotonic() - started
    # the images no tag reaches any more: the layers of builds before this one
    _run([*PODMAN, "image", "prune", "--force"], timeout=300)
    size = int(_run([*PODMAN, "image", "inspect", IMAGE, "--format", "{{.Size}}"], timeout=60))
    return BuiltImage(
        name=IMAGE,
        base=base,
        size_bytes=size,
        seconds={"base": base_seconds, "wheels": wheels_seconds, "build": build_seconds},
    )


@contextmanager
def run_entrypoint(
    image: BuiltImage, args: Sequence[str], log: Path, env: Sequence[str] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """The image's entrypoint with ``args``, as the image's user, with the image's
    environment and ``env`` (``NAME=value``), from the image's own filesystem; stopped
    (SIGTERM) on exit, the image unmounted whatever happened."""
    config = image.config()
    entrypoint = [str(a) for a in config["Entrypoint"]]  # type: ignore[attr-defined]
    environment = [str(e) for e in config.get("Env") or ()]  # type: ignore[attr-defined]
    user = str(config.get("User") or "0:0")
    # /dev and /proc mounted in a private mount namespace: they go away with the process
    script = (
        'root=$1; shift; mount --rbind /dev "$root/dev" && mount -t proc proc "$root/proc" && '
        'exec chroot --userspec="$EPP_USER" "$root" /usr/bin/env -i "$@"'
    )
    process: subprocess.Popen[bytes] | None = None
    try:
        root = _run([*PODMAN, "image", "mount", image.name], timeout=60).strip()
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    *("unshare", "--mount", "--propagation", "private"),
                    *("sh", "-c", script, "epp", root),
                    *environment,
                    *env,
                    *entrypoint,
                    *args,
                ],
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "EPP_USER": user},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        yield process
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        subprocess.run([*PODMAN, "image", "unmount", image.name], capture_output=True, check=False)
