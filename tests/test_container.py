"""The CPU image, built where no registry is reachable (docker/build_cpu_image.sh: a debootstrap
base, then docker/Dockerfile.cpu on it), runs a 2-process Horovod job and the main job."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "docker", "build_cpu_image.sh")


def step(name, timeout):
    done = subprocess.run([SCRIPT, name], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert done.returncode == 0, (name, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout + done.stderr


@pytest.mark.slow
def test_cpu_image_builds_from_debian_packages_and_trains_inside():
    engine = os.environ.get("ENGINE", "podman")
    if not (shutil.which(engine) and shutil.which("debootstrap") and os.geteuid() == 0):
        pytest.skip(f"needs {engine}, debootstrap and root (apt-get install {engine} "
                    f"debootstrap runc)")
    step("base", 1800)
    assert "size" in step("build", 3600)
    horovod = step("horovod", 900)
    assert "[0]<stdout>:[===================>] step 20/20" in horovod
    assert re.search(r"\[0\]<stdout>:validation: loss [0-9.]+, perplexity", horovod)
    main = step("main", 3600)
    bpb = float(re.search(r"validation: loss [0-9.]+, perplexity [0-9.]+, bits_per_byte "
                          r"([0-9.]+)", main).group(1))
    assert bpb < 2.30 and re.search(r"main job in the container: \d+ s wall", main)
