"""The EPP's image, built from the project's Containerfile and run here without a registry.

- **Base**: ``mmdebstrap --variant=minbase`` makes a Debian bookworm root with Python 3.11
  (``python3``, ``python3-venv``), kept as a tarball under ``build/image-cache`` (named by a
  hash of the command, so a second run reuses it) and loaded with ``podman import``.
- **Wheels**: ``make wheels`` (``build/wheels``: the project and its runtime dependencies).
- **Build**: ``podman build --isolation chroot`` with ``BASE_IMAGE`` set to that base.
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
        out = _run(["podman", "image", "inspect", self.name], timeout=60)
        config: dict[str, object] = json.loads(out)[0]["Config"]
        return config


def _base() -> tuple[str, float]:
    """The local base image (imported when missing) and the seconds it took."""
    started = time.monotonic()
    digest = hashlib.sha256(" ".join(_MMDEBSTRAP).encode()).hexdigest()[:12]
    name = f"localhost/epp-base:{digest}"
    exists = subprocess.run(["podman", "image", "exists", name], check=False).returncode == 0
    if not exists:
        CACHE.mkdir(parents=True, exist_ok=True)
        tarball = CACHE / f"base-{digest}.tar"
        if not tarball.exists():
            partial = CACHE / f"base-{digest}.partial.tar"  # the suffix sets the format
            _run([*_MMDEBSTRAP, str(partial)], timeout=900)
            partial.rename(tarball)
        _run(["podman", "import", str(tarball), name], timeout=300)
    return name, time.monotonic() - started


def build_image(tag: str) -> BuiltImage:
    """Builds the Containerfile as ``localhost/epp:<tag>`` on the local base."""
    base, base_seconds = _base()
    started = time.monotonic()
    _run(["make", "--no-print-directory", "wheels"], timeout=900)
    wheels_seconds = time.monotonic() - started
    started = time.monotonic()
    name = f"localhost/epp:{tag}"
    _run(
        [
            "podman",
            "build",
            "--isolation",
            "chroot",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "-f",
            "Containerfile",
            "-t",
            name,
            ".",
        ],
        timeout=900,
    )
    build_seconds = time.monotonic() - started
    size = int(_run(["podman", "image", "inspect", name, "--format", "{{.Size}}"], timeout=60))
    return BuiltImage(
        name=name,
        base=base,
        size_bytes=size,
        seconds={"base": base_seconds, "wheels": wheels_seconds, "build": build_seconds},
    )


def remove_image(image: BuiltImage) -> None:
    subprocess.run(["podman", "rmi", "--force", image.name], capture_output=True, check=False)
    subprocess.run(["podman", "image", "prune", "--force"], capture_output=True, check=False)


@contextmanager
def run_entrypoint(
    image: BuiltImage, args: Sequence[str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """The image's entrypoint with ``args``, as the image's user, with the image's
    environment, from the image's own filesystem; stopped (SIGTERM) on exit."""
    config = image.config()
    entrypoint = [str(a) for a in config["Entrypoint"]]  # type: ignore[attr-defined]
    env = [str(e) for e in config.get("Env") or ()]  # type: ignore[attr-defined]
    user = str(config.get("User") or "0:0")
    root = _run(["podman", "image", "mount", image.name], timeout=60).strip()
    script = (
        f'mount --rbind /dev "{root}/dev" && mount -t proc proc "{root}/proc" && '
        f'exec chroot --userspec={user} "{root}" /usr/bin/env -i "$@"'
    )
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                *("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "epp"),
                *env,
                *entrypoint,
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        subprocess.run(["podman", "image", "unmount", image.name], capture_output=True, check=False)
