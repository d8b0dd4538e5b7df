"""The container image the image test runs (tests/test_container.py), built from a Debian base
made here (no image registry is reachable: ``debootstrap`` plus Debian's python3, passed as
``BASE_IMAGE``) and this machine's CPU torch wheel.  Standard library only, so that ``.ci/run``
can build it in the background (``python3 -m tests.container_image build TAG``) while the rest
of the suite runs, before the project's virtualenv exists: the build is minutes of downloads,
unpacking and the ``vfs`` driver's copies, and the test then only waits for what is left of it.
The background build writes ``TAG.status`` beside its log (``ok``, or ``failed``); the test
waits for it (``wait_for``) and reads the log on failure.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITE = "bookworm"
MIRROR = os.environ.get("PERSONAPLEX_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = "python3,python3-venv,libopus0,curl,ca-certificates"
# Set by .ci/run: the tag of the image it builds in the background, and its log's directory.
PREBUILT = "PERSONAPLEX_TEST_PREBUILT_IMAGE"
PREBUILT_DIR = "PERSONAPLEX_TEST_PREBUILT_DIR"


def torch_wheel() -> Path | None:
    named = os.environ.get("PERSONAPLEX_TEST_TORCH_WHEEL")
    found = sorted(glob.glob("/opt/wheels/torch-*.whl"))
    return Path(named) if named else Path(found[-1]) if found else None


def docker(*args: str, timeout: float = 1200, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    return done


def build(tag: str, work: Path) -> None:
    """Build the image ``tag`` (and its base, ``TAG-base``) in the scratch directory ``work``."""
    rootfs = work / "rootfs"
    try:
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, str(rootfs),
                        MIRROR], check=True, capture_output=True, timeout=1200)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-", f"{tag}-base"], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=600)
        tar.wait()
        if imported.returncode != 0:
            raise RuntimeError(f"docker import failed: {imported.stderr}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    # The build context as .dockerignore lets it through, and this machine's torch wheel.
    context = work / "context"
    for name in ("engines", "orchestrator"):
        shutil.copytree(REPO / name, context / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, context / name)
    wheel = torch_wheel()
    if wheel is None:
        raise RuntimeError("no torch wheel to bring into the image (/opt/wheels or PERSONAPLEX_TEST_TORCH_WHEEL)")
    (context / "wheels").mkdir()
    shutil.copy(wheel, context / "wheels" / wheel.name)
    # This machine reaches the package index through a proxy that inspects TLS: its CAs go in.
    (context / "certs").mkdir()
    if Path("/etc/ssl/certs/ca-certificates.crt").is_file():
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", context / "certs" / "build-host.crt")
    version = wheel.name.split("-")[1].split("+")[0]
    docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={tag}-base",
           "--build-arg", f"TORCH=torch=={version}", "-t", tag, str(context))


def remove(tag: str) -> None:
    docker("rmi", "-f", tag, f"{tag}-base", check=False)
    docker("image", "prune", "-f", check=False)  # the build stage's layers


def status_path(directory: Path, tag: str) -> Path:
    return directory / f"{tag}.status"


def wait_for(tag: str, directory: Path, timeout_s: float = 1800) -> None:
    """Wait for the background build of ``tag`` to end; ``RuntimeError`` with its log's tail
    if it failed or never reported."""
    status = status_path(directory, tag)
    deadline = time.monotonic() + timeout_s
    while not status.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the background build of {tag} did not end within {timeout_s:g} s")
        time.sleep(1)
    if status.read_text().strip() != "ok":
        log = directory / f"{tag}.log"
        tail = log.read_text()[-4000:] if log.exists() else "(no log)"
        raise RuntimeError(f"the background build of {tag} failed:\n{tail}")


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "build":
        print("usage: python3 -m tests.container_image build TAG DIRECTORY  (writes DIRECTORY/TAG.status)",
              file=sys.stderr)
        return 2
    tag, directory = argv[1], Path(argv[2])
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="personaplex-image-") as work:
            build(tag, Path(work))
    except Exception as exc:  # noqa: BLE001 - reported to the waiting test through the status file
        print(f"build of {tag} failed: {exc}", file=sys.stderr)
        status_path(directory, tag).write_text("failed\n")
        return 1
    print(f"built {tag} in {time.monotonic() - started:.0f} s")
    status_path(directory, tag).write_text("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
