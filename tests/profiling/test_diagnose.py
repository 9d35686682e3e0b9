"""Diagnosis rules on run profiles written as the profiler writes them (no training needed)."""
from tfbig.profiling.diagnose import Run, diagnose


def _run(phases, samples=None, strategy="horovod", steps=50):
    records = [{"step": i + 2, "time": 100.0 + i, **phases,
                "total": sum(phases.values())} for i in range(steps)]
    samples = samples or [_sample() for _ in range(10)]
    info = {"tokens_per_step": 1024, "flops_per_token": 1e6, "peak_flops_per_device": 1e11,
            "num_devices": 2, "peak_source": "table:A100:bf16"}
    config = {"train": {"strategy": strategy, "grad_accum_steps": 1, "batch_size": 64,
                        "precision": "fp32", "xla": True, "checkpoint_every": 10},
              "horovod": {"hvd_fp16_allreduce": False}}
    return Run("run", info, config, records, [], samples)


def _sample(cpu=50.0, iowait=0.0, memory=30.0, gpu_util=None):
    gpus = [] if gpu_util is None else [{"index": 0, "utilization_percent": gpu_util,
                                          "memory_used_mb": 1000.0, "memory_total_mb": 16000.0}]
    return {"time": 0.0, "cpu_percent": [cpu, cpu], "cpu_mean": cpu, "iowait_percent": iowait,
            "process_rss_mb": 900.0, "memory_used_percent": memory, "swap_used_percent": 0.0,
            "disk_read_mb_per_sec": 80.0, "process_read_mb_per_sec": 80.0, "gpus": gpus,
            "monitor_cpu_seconds": 0.0}


BASE = {"input": 0.001, "compute": 0.1, "communication": 0.0, "checkpoint": 0.0}


def test_communication_bound_run_gets_allreduce_advice():
    findings = diagnose(_run({**BASE, "communication": 0.06}))
    assert findings[0].kind == "communication-bound"
    assert "37.3% of step time" in findings[0].evidence[0]
    assert any("--hvd_fp16_allreduce" in a for a in findings[0].advice)


def test_swinging_gpu_with_high_io_wait_is_input_bound_without_input_wait():
    swinging = [_sample(iowait=30.0, gpu_util=u) for u in (0, 100, 5, 95, 0, 100)]
    findings = diagnose(_run(BASE, swinging))
    assert [f.kind for f in findings] == ["input-bound"]
    assert "GPU utilisation 50% ± 48 points, I/O wait 30.0%" in findings[0].evidence[1]
    assert any("local SSD" in a for a in findings[0].advice)


def test_one_slow_fetch_is_not_input_bound_but_steady_waits_are():
    hiccup = _run(BASE)
    hiccup.steps[7]["input"], hiccup.steps[7]["total"] = 0.5, 0.601
    assert diagnose(hiccup)[0].kind == "compute-bound"
    assert diagnose(_run({**BASE, "input": 0.02}))[0].kind == "input-bound"


def test_checkpointing_and_memory_pressure_are_reported():
    findings = diagnose(_run({**BASE, "checkpoint": 0.03},
                             [_sample(memory=95.0) for _ in range(4)]))
    assert [f.kind for f in findings] == ["checkpoint-bound", "memory-bound"]
    assert "--checkpoint_every=10" in findings[0].evidence[0]
    assert "host memory up to 95% used" in findings[1].evidence


def test_compute_bound_run_reports_mfu():
    (finding,) = diagnose(_run(BASE, [_sample(gpu_util=97.0)]))
    assert finding.kind == "compute-bound"
    # 1024 tokens per 0.101 s at 1e6 FLOPs/token over 2 x 1e11 peak
    assert "MFU 5.1% of table:A100:bf16" in finding.evidence[1]
    assert any("mixed_bfloat16" in a for a in finding.advice)
