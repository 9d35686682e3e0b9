"""Cluster launch files: every Kubernetes manifest under launch/k8s/ and every Slurm script
under launch/ is parsed and the fields a run depends on are cross-checked (image, command,
process counts, GPUs, shared volume under --data_dir/--model_dir, restart on preemption).

No cluster here: the checks are what the operators and schedulers would act on, read from the
files, plus horovodrun's own argument parser on the MPIJob's command line."""
import ast
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S_FILES = sorted(glob.glob(os.path.join(ROOT, "launch", "k8s", "*.y*ml")))
SLURM_FILES = sorted(glob.glob(os.path.join(ROOT, "launch", "*.sbatch")))
MPI_RESTART_POLICIES = {"Never", "OnFailure"}  # what the MPI Operator's validation accepts
CLEAN_POD_POLICIES = {"None", "Running", "All"}


def preempted_exit_code():
    """tfbig.commands.train.PREEMPTED_EXIT_CODE, read without importing TensorFlow."""
    tree = ast.parse(open(os.path.join(ROOT, "tfbig", "commands", "train.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "PREEMPTED_EXIT_CODE":
            return node.value.value
    raise AssertionError("tfbig/commands/train.py defines no PREEMPTED_EXIT_CODE")


def dockerfile_images():
    """{image tag: Dockerfile text} from the `docker build -f FILE -t TAG` lines in docker/."""
    images = {}
    for path in glob.glob(os.path.join(ROOT, "docker", "Dockerfile.*")):
        text = open(path).read()
        for tag in re.findall(r"docker build .*-t (\S+)", text):
            images[tag] = text
    return images


def command_line(container):
    return list(container.get("command", [])) + list(container.get("args", []))


def flag(argv, name):
    """Value of --name=value in argv (None when absent)."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given {len(values)} times in {argv}"
    return values[0] if values else None


def volume_under(path, pod_spec, container):
    """The pod volume mounted at the longest mount path that contains `path`."""
    mounts = [m for m in container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume of container {container['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    assert mount["name"] in volumes, f"volumeMount {mount['name']} has no volume"
    return volumes[mount["name"]]


def check_shared_run_dirs(argv, pod_spec, container):
    """--data_dir and --model_dir lie on a persistent claim, not on the pod's own disk."""
    for name in ("data_dir", "model_dir"):
        path = flag(argv, name)
        assert path and path.startswith("/"), f"--{name} must be an absolute path, got {path}"
        volume = volume_under(path, pod_spec, container)
        assert "persistentVolumeClaim" in volume, f"--{name}={path} is on {volume}, not a PVC"


def check_resumes(argv):
    every = int(flag(argv, "checkpoint_every") or 200)
    assert every < int(flag(argv, "max_steps")), "no checkpoint before the end: nothing to resume"


def check_image(container):
    images = dockerfile_images()
    assert container["image"] in images, (
        f"image {container['image']} is built by no Dockerfile in docker/ ({sorted(images)})")
    return images[container["image"]]


def gpus(container):
    return int(container["resources"]["limits"]["nvidia.com/gpu"])


def check_tfjob(job):
    spec = job["spec"]["tfReplicaSpecs"]["Worker"]
    assert spec["replicas"] >= 1
    # ExitCode: the operator restarts a pod that exits 128-255 and gives up on 1-127.
    assert spec["restartPolicy"] == "ExitCode" and 128 <= preempted_exit_code() <= 255
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "tensorflow"  # the name the training operator looks for
    check_image(container)
    argv = command_line(container)
    assert argv[0] == "tfbig-train" and flag(argv, "strategy") == "multiworker"
    assert gpus(container) >= 1
    check_shared_run_dirs(argv, pod, container)
    check_resumes(argv)


def operator_hostfile(job, tmp_path):
    """The hostfile the MPI Operator writes for Open MPI: one "host slots=N" line per worker."""
    name, slots = job["metadata"]["name"], job["spec"]["slotsPerWorker"]
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{name}-worker-{i}.{name}.default.svc slots={slots}\n"
                            for i in range(workers)))
    return path


def horovodrun_args(argv, monkeypatch):
    """horovodrun's own parser on the launcher's command line."""
    from horovod.runner import launch

    assert argv[0] == "horovodrun", f"the launcher runs {argv[0]}, not horovodrun"
    monkeypatch.setattr(sys, "argv", argv)
    return launch.parse_args()


def check_prestop_signals_the_ranks(pod, container):
    """The hook's pattern matches a rank's command line and not the hook's own shell."""
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    pattern = re.search(r"pkill -TERM -f '([^']+)'", hook[-1]).group(1)
    rank = "/opt/venv/bin/python3.11 /opt/venv/bin/tfbig-train --strategy=horovod"
    assert re.search(pattern, rank) and not re.search(pattern, " ".join(hook))
    assert pod["terminationGracePeriodSeconds"] >= 60  # one step plus one checkpoint save


def check_mpijob(job, tmp_path, monkeypatch):
    from horovod.runner.common.util import hosts

    spec = job["spec"]
    launcher, worker = spec["mpiReplicaSpecs"]["Launcher"], spec["mpiReplicaSpecs"]["Worker"]
    assert launcher["replicas"] == 1 and worker["replicas"] >= 1
    assert {launcher["restartPolicy"], worker["restartPolicy"]} <= MPI_RESTART_POLICIES
    assert spec["runPolicy"]["backoffLimit"] >= 1
    assert spec["runPolicy"]["cleanPodPolicy"] in CLEAN_POD_POLICIES
    (launch_container,) = launcher["template"]["spec"]["containers"]
    pod = worker["template"]["spec"]
    (work_container,) = pod["containers"]
    assert launch_container["image"] == work_container["image"]
    dockerfile = check_image(work_container)
    # One rank per GPU: the operator's hostfile gives each worker slotsPerWorker slots.
    assert gpus(work_container) == spec["slotsPerWorker"]
    assert "nvidia.com/gpu" not in launch_container.get("resources", {}).get("limits", {})
    args = horovodrun_args(command_line(launch_container), monkeypatch)
    assert args.num_proc == worker["replicas"] * spec["slotsPerWorker"]
    assert args.hostfile == "/etc/mpi/hostfile"  # where the operator mounts it
    host_slots = hosts.parse_host_files(str(operator_hostfile(job, tmp_path)))
    assert sum(int(h.split(":")[1]) for h in host_slots.split(",")) == args.num_proc
    argv = args.command
    assert argv[0] == "tfbig-train" and flag(argv, "strategy") == "horovod"
    # The ranks run on the workers, through their sshd, which the image must have.
    assert command_line(work_container)[0] == "/usr/sbin/sshd" and "openssh-server" in dockerfile
    check_shared_run_dirs(argv, pod, work_container)
    check_resumes(argv)
    check_prestop_signals_the_ranks(pod, work_container)


CHECKS = {("kubeflow.org/v1", "TFJob"): check_tfjob,
          ("kubeflow.org/v2beta1", "MPIJob"): check_mpijob}


def test_the_mpijob_and_tfjob_manifests_exist():
    names = {os.path.basename(p) for p in K8S_FILES}
    assert {"mpijob.yaml", "tfjob.yaml"} <= names


@pytest.mark.parametrize("path", K8S_FILES, ids=os.path.basename)
def test_kubernetes_manifest(path, tmp_path, monkeypatch):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    assert docs, f"{path} holds no document"
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        assert key in CHECKS, f"{path}: no check for {key}; add one to this test"
        check = CHECKS[key]
        if check is check_mpijob:
            check(doc, tmp_path, monkeypatch)
        else:
            check(doc)


def sbatch_options(text):
    """{option: value} of the #SBATCH lines (value True for a bare flag)."""
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            for word in shlex.split(line[len("#SBATCH "):]):
                key, _, value = word.lstrip("-").partition("=")
                options[key] = value or True
    return options


@pytest.mark.parametrize("path", SLURM_FILES, ids=os.path.basename)
def test_slurm_script(path):
    assert SLURM_FILES
    text = open(path).read()
    subprocess.run(["bash", "-n", path], check=True)  # syntax
    options = sbatch_options(text)
    assert int(options["nodes"]) >= 1 and int(options["gpus-per-node"]) >= 1
    assert options["ntasks-per-node"] == "1"  # one MultiWorkerMirrored worker drives a node's GPUs
    assert options["requeue"] is True and options["signal"].startswith("TERM@")
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    argv = shlex.split(srun.rstrip("\\")) + shlex.split(text.split(srun, 1)[1].split("\n")[1])
    assert "tfbig-train" in argv and flag(argv, "strategy") == "multiworker"
    assert flag(argv, "cluster_resolver") == "slurm"
    # The job requeues itself on exactly the code tfbig-train exits with after a SIGTERM save.
    requeue = re.search(r'"\$code" -eq (\d+) \]; then\s+\S.*\n\s+scontrol requeue', text)
    assert requeue and int(requeue.group(1)) == preempted_exit_code()
