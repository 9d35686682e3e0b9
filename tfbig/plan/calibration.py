"""A calibration: what `tfbig-doctor --calibration_out=FILE` measured on a cluster, read by
`tfbig-plan --calibration=FILE` and `tfbig-train --plan_only --calibration=FILE` in place of the
spec table.

Why it is built this way: docs/design/notes/plan.md (tfbig.plan.calibration).
"""
import dataclasses
import json

from tfbig.plan import hardware

SCHEMA = "tfbig-calibration/1"
BUS_FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
               "reducescatter": lambda n: (n - 1) / n}
PRECISION_KEYS = {"fp32": "fp32", "mixed_float16": "fp16", "mixed_bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A calibration file, read (`load`)."""

    path: str
    device_kind: str
    device_name: str
    memory_bytes: float
    peak_flops: dict  # precision key -> FLOP/s
    matmul_efficiency: dict  # precision key -> ((size, fraction), ...) by size
    memory_bandwidth: float
    collectives: dict
    normalisation_bandwidth: float = 0.0  # 0: not measured (memory_bandwidth stands in)
    update_seconds_per_variable: float = 0.0  # 0: not measured  # scope -> kind -> (ranks, ((bytes, seconds), ...))

    def peak(self, precision):
        key = PRECISION_KEYS.get(precision, precision)
        if key not in self.peak_flops:
            raise ValueError(f"--calibration={self.path} has no {key} matmul figure (it has "
                             f"{sorted(self.peak_flops)}): rerun tfbig-doctor with "
                             f"--precisions including {key}, or plan another --precision")
        return self.peak_flops[key]

    def efficiency(self, precision, size):
        """Achieved / peak of a square matmul of `size` at `precision`."""
        key = PRECISION_KEYS.get(precision, precision)
        return hardware.log_interpolate(self.matmul_efficiency[key], size)

    def has(self, scope):
        return scope in self.collectives

    def collective_seconds(self, scope, kind, size, ranks):
        """Seconds of a `kind` collective of `size` bytes over `ranks` ranks in `scope`, from
        the bus bandwidth measured at that size; never below the measured smallest time."""
        measured_ranks, rows = self.collectives[scope][kind]
        factor = BUS_FACTORS[kind](measured_ranks)
        busbw = hardware.log_interpolate([(b, factor * b / s) for b, s in rows], size)
        return max(rows[0][1], BUS_FACTORS[kind](ranks) * size / busbw)


def _fail(path, message):
    raise ValueError(f"--calibration={path}: {message}; write one with tfbig-doctor "
                     f"--calibration_out={path}")


def load(path):
    """The Calibration in file `path` (a ValueError naming the flag and what is wrong)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        _fail(path, "no such file")
    except json.JSONDecodeError as error:
        _fail(path, f"not JSON ({error})")
    if data.get("schema") != SCHEMA:
        _fail(path, f"schema {data.get('schema')!r}, expected {SCHEMA!r}")
    try:
        efficiency = {p: tuple(sorted((int(s), float(v)) for s, v in table.items()))
                      for p, table in data["matmul_efficiency"].items()}
        collectives = {scope: {kind: (int(t["ranks"]), tuple(zip(t["bytes"], t["seconds"])))
                               for kind, t in kinds.items()}
                       for scope, kinds in data.get("collectives", {}).items()}
        return Calibration(path, data["device"]["kind"], data["device"]["name"],
                           float(data["device"]["memory_bytes"]),
                           {k: float(v) for k, v in data["peak_flops"].items()}, efficiency,
                           float(data["memory_bandwidth"]), collectives,
                           float(data.get("normalisation_bandwidth", 0.0)),
                           float(data.get("update_seconds_per_variable", 0.0)))
    except (KeyError, TypeError, ValueError) as error:
        _fail(path, f"missing or malformed field {error}")


def compute_efficiency(efficiency, peak, bandwidth, value_bytes):
    """((size, fraction), ...) of a square matmul's FLOPs alone: its measured time less its
    operands and result (3 size^2 values) streamed at `bandwidth`, the traffic term the plan
    adds to every product (tfbig.plan.estimate.matmul_fraction), so that the plan gives back
    the measured time of each square product. At least a tenth of the measured time stays
    compute (a product that small is all launch and traffic)."""
    fractions = []
    for size, fraction in efficiency:
        measured = 2.0 * size ** 3 / (peak * fraction)
        compute = max(measured - 3.0 * size ** 2 * value_bytes / bandwidth, 0.1 * measured)
        fractions.append((size, 2.0 * size ** 3 / (peak * compute)))
    return tuple(fractions)


def device(calibration, precision):
    """The hardware.Device a calibration measured, at a tfbig --precision: its peak, its
    matmul efficiency by size (its compute part: `compute_efficiency`), its element-wise
    bandwidth (already achieved: fraction 1), its links at the intra-host all-reduce's best
    bus bandwidth (memory bandwidth without one)."""
    key = PRECISION_KEYS.get(precision, precision)
    peak = calibration.peak(precision)
    efficiency = compute_efficiency(calibration.matmul_efficiency[key], peak,
                                    calibration.memory_bandwidth, 4 if key == "fp32" else 2)
    link = calibration.memory_bandwidth
    if calibration.has("intra_host"):
        ranks, rows = calibration.collectives["intra_host"]["allreduce"]
        link = max(BUS_FACTORS["allreduce"](ranks) * b / s for b, s in rows)
    gpu = calibration.device_kind == "gpu"
    return hardware.Device(f"{calibration.device_name} (measured)", peak,
                           calibration.memory_bytes, calibration.memory_bandwidth, link,
                           matmul_fraction=max(v for _, v in efficiency),
                           reserve_bytes=hardware.GPU_RESERVE_BYTES if gpu else 0.0,
                           bandwidth_fraction=1.0, matmul_efficiency=efficiency,
                           normalisation_bandwidth=calibration.normalisation_bandwidth,
                           update_seconds_per_variable=calibration.update_seconds_per_variable)


def cluster(calibration, precision, gpus_per_node, nodes, internode_bandwidth):
    """A hardware.Cluster of the calibrated device whose collectives take the measured times."""
    return hardware.Cluster(device(calibration, precision), gpus_per_node, nodes,
                            internode_bandwidth, calibration)
