"""From every rank's measurements to what a user acts on: stragglers, problems, the text
report, and the calibration file tfbig-plan reads (tfbig.plan.calibration documents its schema).

A straggler is a rank (or, with several hosts, a host: the median of its ranks) whose figure on a
measurement is at least `threshold` (20%) below the median of all of them. Measurements, all
rates (higher is better): matmul_<precision> (TFLOP/s at the best size), memory_bandwidth,
softmax_bandwidth, training_step (steps/s of the tiny model).
"""
import datetime
import statistics

from tfbig.plan import calibration as calibration_lib
from tfbig.plan import hardware

FIXES = {"gloo": "rebuild Horovod with HOROVOD_WITH_GLOO=1 (pip install --no-cache-dir horovod)",
         "mpi": "install an MPI (Open MPI 4+) and rebuild Horovod with HOROVOD_WITH_MPI=1",
         "nccl": "on a GPU cluster rebuild Horovod with HOROVOD_GPU_OPERATIONS=NCCL (and "
                 "NCCL installed); without it gradients cross the CPU over Gloo/MPI"}


def rank_measurements(record):
    """{measurement: rate} of one rank's record."""
    values = {f"matmul_{p}": max(rates.values()) for p, rates in record["matmul_tflops"].items()}
    values["memory_bandwidth"] = record["memory_bandwidth_gbps"]
    values["softmax_bandwidth"] = record["softmax_bandwidth_gbps"]
    values["training_step"] = record["steps_per_sec"]
    return values


def stragglers(records, threshold):
    """[{scope, rank or host, host, measurement, value, median, below}] for each rank (and each
    host, with several) at least `threshold` below the median of a measurement."""
    found = []
    per_rank = {r["rank"]: rank_measurements(r) for r in records}
    host_of = {r["rank"]: r["host"] for r in records}
    for name in per_rank[records[0]["rank"]]:
        values = {rank: m[name] for rank, m in per_rank.items() if name in m}
        found += below_median(values, threshold, name, "rank", host_of)
        hosts = {}
        for rank, value in values.items():
            hosts.setdefault(host_of[rank], []).append(value)
        if len(hosts) > 1:
            found += below_median({h: statistics.median(v) for h, v in hosts.items()}, threshold,
                            name, "host", {h: h for h in hosts})
    return found


STRAGGLER_THRESHOLD = 0.2  # tfbig-doctor's --straggler_threshold default; training's rule


def below_median(values, threshold, name, scope, host_of):
    """The straggler rule, on rates (higher is better): [{scope, rank or host, host,
    measurement, value, median, below}] for each key of `values` whose rate is at least
    `threshold` below the median of all (tfbig-doctor's measurements, training's steps/s)."""
    if len(values) < 2:
        return []
    median = statistics.median(values.values())
    return [{"scope": scope, scope: key, "host": host_of[key], "measurement": name,
             "value": value, "median": median, "below": 1 - value / median}
            for key, value in sorted(values.items()) if value < (1 - threshold) * median]


def problems(records, correctness, require, hosts):
    """Sentences naming what is wrong with the build or the environment (empty: nothing)."""
    found = []
    first = records[0]["build"]
    for record in records:
        build, where = record["build"], f"rank {record['rank']} on {record['host']}"
        if build["horovod"] is None:
            found.append(f"{where}: Horovod cannot be imported ({build['horovod_error']}); "
                         f"install it with ./install.sh")
        built = {**build["controllers"], **build["gpu_operations"]}
        for name in require:
            if not built.get(name):
                have = ", ".join(k for k, v in built.items() if v) or "none"
                found.append(f"--require={name}: Horovod {build['horovod']} on {where} was built "
                             f"without {name.upper()} (built with: {have}); {FIXES[name]}")
        for key in ("tensorflow", "keras", "horovod"):
            if build[key] != first[key]:
                found.append(f"{where} runs {key} {build[key]}, rank 0 runs {first[key]}: "
                             f"install the same versions on every host")
        if not record["xla"]["compiles"]:
            found.append(f"{where}: XLA does not compile a small step "
                         f"({record['xla']['error']}); train without --xla there")
    if not correctness["agrees"]:
        found.append(f"one training step averaged across ranks differs from one device by "
                     f"{correctness['relative_difference']:.2g} (relative): the collectives "
                     f"return wrong values; check the Horovod build and the network")
    if len(hosts) > 1 and not any(r["interconnect"]["rdma_devices"] for r in records):
        found.append("the hosts talk over TCP: no InfiniBand/EFA device "
                     "(/sys/class/infiniband) on any host; ask for the cluster's RDMA network "
                     "(EFA: the aws-ofi-nccl plugin, FI_PROVIDER=efa)")
    return found


def straggler_line(s):
    who = f"rank {s['rank']} on host {s['host']}" if s["scope"] == "rank" else (
        f"host {s['host']}")
    return (f"STRAGGLER: {who}: {s['measurement']} {s['value']:.4g}, {s['below']:.0%} below "
            f"the median {s['median']:.4g}")


def text(report):
    """The report as text: the verdict, stragglers and problems first, then the details."""
    lines = [f"tfbig-doctor: {report['ranks']} rank(s) on {len(report['hosts'])} host(s) "
             f"({', '.join(report['hosts'])}), controller {report['controller']}: "
             f"{'OK' if not (report['stragglers'] or report['problems']) else 'ATTENTION'}"]
    lines += [straggler_line(s) for s in report["stragglers"]]
    lines += [f"PROBLEM: {p}" for p in report["problems"]]
    lines.append("build:")
    for r in report["per_rank"]:
        b = r["build"]
        built = [k for k, v in {**b["controllers"], **b["gpu_operations"]}.items() if v]
        lines.append(f"  rank {r['rank']} host {r['host']}: TF {b['tensorflow']}, Keras "
                     f"{b['keras']}, Horovod {b['horovod']} (built: {', '.join(built) or '-'})"
                     f"; {r['device']['name']}; XLA {'ok' if r['xla']['compiles'] else 'FAILS'};"
                     f" precisions {', '.join(p for p, ok in r['precisions'].items() if ok)}")
    lines.append("per device (TFLOP/s by matmul size; memory and softmax GB/s; tiny steps/s):")
    for r in report["per_rank"]:
        matmul = "; ".join(f"{p} " + " ".join(f"{s}:{v:.3g}" for s, v in rates.items())
                           for p, rates in r["matmul_tflops"].items())
        spec = r["spec"] if isinstance(r["spec"], str) else (
            f"spec {r['spec']['tflops']} TFLOP/s, {r['spec']['memory_bandwidth_gbps']} GB/s")
        lines.append(f"  rank {r['rank']}: {matmul}; memory {r['memory_bandwidth_gbps']:.3g}; "
                     f"softmax {r['softmax_bandwidth_gbps']:.3g}; "
                     f"update {r['update_us_per_variable']:.3g} us/variable; "
                     f"step {r['steps_per_sec']:.3g}; {spec}")
    lines += _collective_lines(report["collectives"])
    c = report["correctness"]
    lines.append(f"correctness: one step on {report['ranks']} rank(s) vs one device: max "
                 f"gradient difference {c['max_gradient_difference']:.3g} (relative "
                 f"{c['relative_difference']:.3g}): {'agrees' if c['agrees'] else 'DIFFERS'}")
    return "\n".join(lines)


def _collective_lines(collectives):
    lines = ["collectives (nccl-tests' algbw/busbw, GB/s; time in us):"]
    if "skipped" in collectives:
        return lines + [f"  skipped: {collectives['skipped']}"]
    for scope, table in collectives.items():
        if "skipped" in table:
            lines.append(f"  {scope}: skipped ({table['skipped']})")
            continue
        lines.append(f"  {scope} ({len(table['groups'])} group(s) of {table['ranks_per_group']})"
                     f"  bytes  " + "  ".join(f"{row['bytes']:>8}" for row in
                                              table["allreduce"]["rows"]))
        for kind in ("allreduce", "allgather", "reducescatter"):
            rows = table[kind]["rows"]
            lines.append(f"    {kind:<14} busbw " + " ".join(f"{r['busbw_gbps']:>9.3g}"
                                                             for r in rows)
                         + f"  latency {table[kind]['latency_us']:.0f} us")
    return lines


def spec_of(device):
    """The planner's table entry of a device ({"name", "tflops", "memory_bandwidth_gbps"}),
    or a sentence saying it has none."""
    for name, (peaks, _, bandwidth, _) in hardware.GPUS.items():
        if device["kind"] == "gpu" and name.split("-")[0] in device["name"]:
            return {"name": name, "tflops": peaks, "memory_bandwidth_gbps": bandwidth}
    return f"not in the planner's table ({device['kind']}: the calibration replaces it)"


def calibration(report):
    """The calibration tfbig-plan --calibration reads (tfbig.plan.calibration's schema): the
    median rank's figures, and the intra- and inter-host collectives."""
    records = report["per_rank"]
    peaks, efficiency = {}, {}
    for precision in records[0]["matmul_tflops"]:
        sizes = set.intersection(*(set(r["matmul_tflops"][precision]) for r in records))
        by_size = {size: statistics.median(r["matmul_tflops"][precision][size] for r in records)
                   for size in sorted(sizes, key=int)}
        peaks[precision] = max(by_size.values()) * 1e12
        efficiency[precision] = {size: v * 1e12 / peaks[precision] for size, v in by_size.items()}
    collectives = {}
    for scope in ("intra_host", "inter_host"):
        table = report["collectives"].get(scope, {})
        if "groups" in table:
            collectives[scope] = {kind: {"ranks": table["ranks_per_group"],
                                         "bytes": [r["bytes"] for r in table[kind]["rows"]],
                                         "seconds": [r["time_us"] / 1e6
                                                     for r in table[kind]["rows"]]}
                                  for kind in ("allreduce", "allgather", "reducescatter")}
    device = records[0]["device"]
    return {"schema": calibration_lib.SCHEMA, "measured_by": "tfbig-doctor",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "hosts": len(report["hosts"]), "ranks": report["ranks"],
            "device": {"kind": device["kind"], "name": device["name"],
                       "memory_bytes": _memory_per_rank(report),
                       "threads": device.get("threads", 0)},
            "peak_flops": peaks, "matmul_efficiency": efficiency,
            "memory_bandwidth": statistics.median(r["memory_bandwidth_gbps"]
                                                  for r in records) * 1e9,
            "normalisation_bandwidth": statistics.median(r["softmax_bandwidth_gbps"]
                                                         for r in records) * 1e9,
            "update_seconds_per_variable": statistics.median(r["update_us_per_variable"]
                                                             for r in records) / 1e6,
            "collectives": collectives}


def _memory_per_rank(report):
    """A GPU's memory, or a CPU host's RAM shared by the ranks on it."""
    records = report["per_rank"]
    memory = min(r["memory_bytes"] for r in records)
    if records[0]["device"]["kind"] == "gpu":
        return memory
    return memory / max(list(report["rank_hosts"].values()).count(h) for h in report["hosts"])
