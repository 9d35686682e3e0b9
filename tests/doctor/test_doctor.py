"""tfbig-doctor under real `horovodrun --gloo` launches on localhost, and the pieces it is made of
(stragglers, groups, problems) on records built by hand.

The launched runs slow one rank on purpose through the test-only hook of tfbig.doctor.probes
(TFBIG_DOCTOR_TEST_DELAY_RANK): it must be named as the straggler, with its host, in the first
lines, and --strict must then fail the command.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from tfbig.doctor import collectives, findings
from tfbig.plan import calibration

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# Fields that may be zero or empty by nature: an exact gradient match, no RDMA device here.
MAY_BE_ZERO = {"max_gradient_difference", "relative_difference", "local_rank", "rank",
               "rdma_devices", "network_variables", "stragglers", "problems", "threads",
               "groups"}


def doctor(tmp_path, ranks, flags, delay_rank=None, timeout=600):
    """(exit status, output, report) of `horovodrun -np RANKS tfbig-doctor --quick FLAGS`."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_NUM_INTEROP_THREADS": "1",
           "TF_NUM_INTRAOP_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    if delay_rank is not None:
        env["TFBIG_DOCTOR_TEST_DELAY_RANK"] = str(delay_rank)
    report = tmp_path / "report.json"
    command = [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               sys.executable, "-m", "tfbig.doctor", "--quick", f"--output={report}", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert report.exists(), output[-5000:]
    return proc.returncode, output, json.loads(report.read_text())


def numbers(value, path=""):
    """(path, value) of every number and empty container in a JSON value."""
    if isinstance(value, dict):
        if not value:
            yield path, value
        for key, item in value.items():
            if key not in MAY_BE_ZERO:
                yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        if not value:
            yield path, value
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def rank0_lines(output):
    return [line.split(":", 1)[1] for line in output.splitlines()
            if line.startswith("[0]<stdout>:")]


@pytest.mark.slow  # a 2-rank launch; the doctor's report and straggler rule: the single-process tests here and tests/distribute/test_stragglers.py
@pytest.mark.multiproc
def test_two_ranks_report_every_field_and_name_the_slowed_rank(tmp_path):
    calibration_file = tmp_path / "calibration.json"
    code, output, report = doctor(tmp_path, 2, ["--strict", "--require=gloo,mpi",
                                               f"--calibration_out={calibration_file}"],
                                  delay_rank=1)
    assert code != 0, output[-3000:]  # --strict with a straggler and a missing controller
    bad = [(path, value) for path, value in numbers(report) if not value or value <= 0]
    assert not bad, bad
    for section in ("build", "device", "xla", "precisions", "matmul_tflops",
                    "memory_bandwidth_gbps", "softmax_bandwidth_gbps", "update_us_per_variable",
                    "steps_per_sec", "spec", "interconnect"):
        assert all(section in record for record in report["per_rank"]), section
    assert report["rank_hosts"] == {"0": report["hosts"][0], "1": report["hosts"][0]}
    table = report["collectives"]["intra_host"]
    assert set(table) >= {"allreduce", "allgather", "reducescatter"}
    assert [row["bytes"] for row in table["allreduce"]["rows"]][0] == 4096
    assert report["collectives"]["inter_host"] == {"skipped": "one host"}
    assert report["correctness"]["agrees"]
    # the slowed rank, with its host, right after the verdict line
    lines = rank0_lines(output)
    assert "ATTENTION" in lines[0]
    assert any(s["rank"] == 1 and s["measurement"] == "training_step"
               for s in report["stragglers"])
    assert not any(s["rank"] == 0 for s in report["stragglers"])
    assert f"STRAGGLER: rank 1 on host {report['hosts'][0]}" in lines[1]
    # Horovod here is built with Gloo only: MPI named as missing, the run carried on
    assert any("--require=mpi" in p and "without MPI" in p for p in report["problems"])
    assert not any("--require=gloo" in p for p in report["problems"])
    loaded = calibration.load(str(calibration_file))
    assert loaded.has("intra_host") and loaded.peak("fp32") > 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_four_ranks_measure_partition_groups_and_without_strict_exit_zero(tmp_path):
    code, output, report = doctor(tmp_path, 4, [], delay_rank=2)
    assert code == 0, output[-3000:]
    assert report["collectives"]["partition_2"]["groups"] == [[0, 1], [2, 3]]
    assert any(s["rank"] == 2 for s in report["stragglers"])
    bad = [(path, value) for path, value in numbers(report) if not value or value <= 0]
    assert not bad, bad


def record(rank, host, rate=1.0):
    return {"rank": rank, "host": host, "matmul_tflops": {"fp32": {"256": rate}},
            "memory_bandwidth_gbps": 10.0, "softmax_bandwidth_gbps": 3.0, "steps_per_sec": 5.0}


def test_a_slow_host_is_named_as_a_host_and_its_ranks_as_ranks():
    records = [record(0, "a"), record(1, "a"), record(2, "b", 0.5), record(3, "b", 0.5),
               record(4, "c"), record(5, "c")]
    found = findings.stragglers(records, 0.2)
    assert {(s["scope"], s.get("rank"), s["host"]) for s in found} == {
        ("rank", 2, "b"), ("rank", 3, "b"), ("host", None, "b")}
    assert all(s["measurement"] == "matmul_fp32" for s in found)
    # 19% below the median is not a straggler at the 20% threshold
    assert not findings.stragglers([record(0, "a"), record(1, "a", 0.81), record(2, "a")], 0.2)


def test_groups_inside_across_hosts_and_of_partitions():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    groups = collectives.scope_groups(hosts, quick=False)
    assert groups["intra_host"] == [[0, 1], [2, 3]]
    assert groups["inter_host"] == [[0, 2], [1, 3]]
    assert groups["partition_2"] == [[0, 1], [2, 3]]
    single = collectives.scope_groups({0: "a", 1: "b"}, quick=True)
    assert single["intra_host"] == "one rank per host" and single["inter_host"] == [[0, 1]]


def test_a_horovod_that_cannot_be_imported_is_a_problem_not_a_crash():
    build = {"horovod": None, "horovod_error": "No module named 'horovod'", "tensorflow": "2",
             "keras": "3", "controllers": {"gloo": False, "mpi": False},
             "gpu_operations": {"nccl": False}}
    records = [{"rank": 0, "host": "a", "build": build, "xla": {"compiles": True},
                "interconnect": {"rdma_devices": []}}]
    found = findings.problems(records, {"agrees": True}, ["nccl"], ["a"])
    assert any("cannot be imported" in p for p in found)
    assert any("--require=nccl" in p and "HOROVOD_GPU_OPERATIONS=NCCL" in p for p in found)


def test_bus_bandwidth_follows_nccl_tests():
    per_rank = [{kind: {2 ** 20: 0.01} for kind in collectives.KINDS}] * 4
    table = collectives.summarize([[0, 1, 2, 3]], per_rank)
    row = table["allreduce"]["rows"][0]
    assert row["algbw_gbps"] == pytest.approx(2 ** 20 / 0.01 / 1e9)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * 3 / 4)
    assert table["allgather"]["rows"][0]["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 3 / 4)


@pytest.mark.parametrize("argv, message", [
    (["--require=ib"], "--require=ib: ib not one of gloo, mpi, nccl"),
    (["--precisions=fp32,fp64"], "--precisions=fp32,fp64: fp64 not one of fp32, bf16, fp16"),
    (["--straggler_threshold=1.5"], "--straggler_threshold=1.5: expected a fraction"),
])
def test_bad_flags_are_named_errors(argv, message, capsys):
    from tfbig.commands import doctor as cli

    with pytest.raises(SystemExit) as exit_info:
        cli.parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_small_matmuls_are_batched_so_that_launching_a_call_is_not_timed(monkeypatch):
    """One 64 x 64 pair per call is mostly the call's launch (it read 2% of the 1024 rate here
    and stopped the probe before the large sizes); a call multiplies as many pairs as last
    CALL_SECONDS, within BATCH_BYTES."""
    import tensorflow as tf

    from tfbig.doctor import probes

    def modelled(batch):  # a 1 ms launch, then 10 us a pair
        return 1e-3 + 1e-5 * batch

    batch = probes._matmul_batch("/CPU:0", 64, tf.float32, modelled)
    assert modelled(batch) >= probes.CALL_SECONDS > modelled(batch // 2)
    monkeypatch.setattr(probes, "BATCH_BYTES", 64 * 64 * 4 * 3)
    assert probes._matmul_batch("/CPU:0", 64, tf.float32, modelled) == 3
    monkeypatch.undo()
    assert probes._matmul_batch("/CPU:0", 32, tf.float32) > 1  # a real 32 x 32 pair: < 10 ms


def test_a_slow_small_size_does_not_stop_the_larger_ones(monkeypatch):
    """The next size is skipped only when the size before it predicts a call over the limit:
    the slowest rate seen (the smallest size's, mostly its launch) used to skip every large
    size."""
    from tfbig.doctor import probes

    rates = {16: 1e7, 64: 5e10, 256: 5e10, 1024: 1e9, 4096: 1e9}  # FLOP/s of each size
    timed = iter(rates)  # matmul_flops times the sizes in order

    def seconds_of_next_size(run, seconds, delay):
        size = next(timed)
        return 2.0 * size ** 3 / rates[size]

    monkeypatch.setattr(probes, "_matmul_batch", lambda device, size, dtype: 1)
    monkeypatch.setattr(probes, "typical_seconds", seconds_of_next_size)
    measured = probes.matmul_flops("/CPU:0", list(rates), ["fp32"], 0.0, longest_call=1.0)
    # 1024 after 256's 5e10 FLOP/s: 0.04 s; 4096 after 1024's 1e9 FLOP/s: 137 s, left out
    assert list(measured["fp32"]) == ["16", "64", "256", "1024"]
