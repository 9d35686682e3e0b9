"""What `tfbig-doctor` runs on every rank: its own record (build, device, precisions, rates of a
matmul, a memory copy, a softmax, an optimizer update and a training step), then the
collectives the ranks measure together, and the findings (stragglers, problems)."""

PROG = "tfbig-doctor"


# (largest collective, matmul sizes on a CPU, on a GPU, seconds per timed probe, bandwidth probe)
MODES = {"quick": (2 ** 20, (128, 512), (1024, 4096), 0.1, 2 ** 24),
         "full": (2 ** 28, (64, 256, 1024, 2048), (1024, 4096, 8192), 0.5, 2 ** 28)}


def largest_collective(args, local_ranks):
    """--max_bytes (or the mode's), capped so that a host's ranks hold their buffers (input,
    output and Horovod's copy of each) in an eighth of its free memory."""
    import psutil

    wanted = args.max_bytes or MODES["quick" if args.quick else "full"][0]
    return min(wanted, psutil.virtual_memory().available // (8 * 4 * local_ranks))


def measure_rank(args, ranks):
    """This rank's record: host, build, device and its rates."""
    from tfbig.doctor import findings, probes

    _, cpu_sizes, gpu_sizes, seconds, bandwidth_bytes = MODES["quick" if args.quick else "full"]
    device, description = probes.rank_device(ranks.local_rank)
    delay = probes.test_delay(ranks.rank)
    precisions = probes.precisions_run(device)
    sizes = gpu_sizes if description["kind"] == "gpu" else cpu_sizes
    runnable = [p for p in args.precisions if precisions[p]]
    return {"rank": ranks.rank, "host": probes.host_name(), "local_rank": ranks.local_rank,
            "build": probes.build_info(), "device": description,
            "memory_bytes": probes.memory_bytes(description["kind"]),
            "interconnect": probes.interconnect(), "xla": probes.xla_compiles(device),
            "precisions": precisions,
            "matmul_tflops": {p: {s: v / 1e12 for s, v in rates.items()} for p, rates in
                              probes.matmul_flops(device, sizes, runnable, seconds,
                                                  delay).items()},
            "memory_bandwidth_gbps": probes.memory_bandwidth(device, bandwidth_bytes, seconds,
                                                             delay) / 1e9,
            "softmax_bandwidth_gbps": probes.normalisation_bandwidth(
                device, bandwidth_bytes, seconds, delay) / 1e9,
            "update_us_per_variable": 1e6 * probes.update_seconds_per_variable(device, seconds,
                                                                              delay),
            "steps_per_sec": probes.step_rate(device, seconds, delay),
            "spec": findings.spec_of(description)}, device


def run_checks(args):
    """The report (a dict), the same on every rank."""
    from tfbig.doctor import collectives, findings

    ranks = collectives.Ranks()
    record, device = measure_rank(args, ranks)
    records = ranks.gather(record)
    rank_hosts = {r["rank"]: r["host"] for r in records}
    hosts = list(dict.fromkeys(rank_hosts.values()))
    local_ranks = max(list(rank_hosts.values()).count(h) for h in hosts)
    max_bytes = largest_collective(args, local_ranks)
    measured = (collectives.measure_all(ranks, rank_hosts, max_bytes, args.quick)
                if ranks.size > 1 else {"skipped": "one rank"})
    correctness = ranks.gather(collectives.training_step_check(ranks, device))
    worst = max(correctness, key=lambda c: c["relative_difference"])
    report = {"tool": PROG, "ranks": ranks.size, "hosts": hosts,
              "rank_hosts": {str(k): v for k, v in rank_hosts.items()},
              "controller": ranks.controller, "max_collective_bytes": max_bytes,
              "per_rank": records, "collectives": measured, "correctness": worst}
    report["stragglers"] = findings.stragglers(records, args.straggler_threshold)
    report["problems"] = findings.problems(records, worst, args.require, hosts)
    return ranks, report
