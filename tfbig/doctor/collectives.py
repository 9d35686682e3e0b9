"""What the ranks measure together: collectives over the groups a layout uses, and one
training step against one device.

Bandwidths are reported as nccl-tests reports them (its doc/PERFORMANCE.md): for a collective
of S bytes (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the
input) over n ranks taking t seconds,
    algbw = S / t
    busbw = algbw x 2 (n - 1) / n   (all-reduce)
    busbw = algbw x (n - 1) / n     (all-gather, reduce-scatter)
busbw is the bandwidth each rank's link sustains, comparable across collectives and group sizes
and with the link's rate; t at the smallest size is the latency. t is the slowest member's mean
over the repeated calls (a collective is done when its last rank is).

Groups ("scopes"): intra_host (the ranks of each host, all hosts at once), inter_host (one rank
per host: the ranks with the same local index), partition_<g> (MiCS partition groups: g
consecutive ranks, as ZeRO's --shard_degree=g groups them).
"""
import os
import time

from tfbig.plan.calibration import BUS_FACTORS  # what the plan reads back from busbw

KINDS = ("allreduce", "allgather", "reducescatter")
FIRST_BYTES = 4 * 2 ** 10


def message_sizes(max_bytes):
    """4 KiB, 16 KiB, ... (x4) up to `max_bytes`."""
    sizes, size = [], FIRST_BYTES
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def repeats(size, quick):
    """Calls timed per size: many for small messages (latency), two for the largest."""
    count = max(2, min(20, 2 ** 24 // size))
    return min(count, 5) if quick else count


class Ranks:
    """This process's view of the job through Horovod (a job of one when it is not there)."""

    def __init__(self):
        try:
            import horovod.tensorflow as hvd
        except ImportError:
            self.hvd, self.rank, self.size, self.local_rank = None, 0, 1, 0
            return
        # process sets for the groups are only known once the ranks have told their hosts
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
        hvd.init()
        self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()
        self.local_rank = hvd.local_rank()

    @property
    def controller(self):
        """The controller this job runs on: gloo, mpi, or None without Horovod."""
        if self.hvd is None:
            return None
        return "mpi" if self.hvd.mpi_enabled() else "gloo" if self.hvd.gloo_enabled() else None

    def gather(self, value):
        """[value of rank 0, rank 1, ...] on every rank."""
        return self.hvd.allgather_object(value) if self.hvd and self.size > 1 else [value]

    def process_set(self, members):
        """A Horovod process set of `members` (the global one when it is everyone); every
        rank must call it with the same members in the same order."""
        if len(members) == self.size:
            return self.hvd.global_process_set
        return self.hvd.add_process_set(members)


def scope_groups(rank_hosts, quick):
    """{scope: [member ranks of each group]} for a {rank: host} map; a scope whose groups would
    have one rank is {scope: reason it is skipped} instead."""
    hosts = {}
    for rank in sorted(rank_hosts):
        hosts.setdefault(rank_hosts[rank], []).append(rank)
    groups = list(hosts.values())
    size = len(rank_hosts)
    scopes = {"intra_host": [g for g in groups if len(g) > 1] or "one rank per host",
              "inter_host": "one host" if len(hosts) == 1 else [
                  [g[i] for g in groups if i < len(g)] for i in range(max(map(len, groups)))]}
    scopes["inter_host"] = [g for g in scopes["inter_host"] if len(g) > 1] if isinstance(
        scopes["inter_host"], list) else scopes["inter_host"]
    partitions = [g for g in range(2, size) if size % g == 0]
    for g in partitions[-1:] if quick else partitions:
        scopes[f"partition_{g}"] = [list(range(k, k + g)) for k in range(0, size, g)]
    return scopes


def time_collective(hvd, kind, size, process_set, members, calls):
    """Mean seconds of one `kind` call of `size` bytes (float32) in `process_set`."""
    import tensorflow as tf

    n = len(members)
    elements = max(n, size // 4 // n * n)
    shape = [elements // n] if kind == "allgather" else [elements]
    x = tf.ones(shape, tf.float32)
    run = {"allreduce": lambda: hvd.allreduce(x, op=hvd.Sum, process_set=process_set),
           "allgather": lambda: hvd.allgather(x, process_set=process_set),
           "reducescatter": lambda: hvd.reducescatter(x, op=hvd.Sum, process_set=process_set)}[
        kind]
    run().numpy()  # warm-up: Horovod negotiates the tensor once
    start = time.perf_counter()
    for _ in range(calls):
        out = run()
    out.numpy()
    return (time.perf_counter() - start) / calls


def measure_scope(ranks, groups, sizes, quick):
    """{kind: {size: seconds}} this rank measured in its group of `groups` ({} if in none)."""
    sets = [ranks.process_set(members) for members in groups]  # every rank, same order
    mine = [(s, m) for s, m in zip(sets, groups) if ranks.rank in m]
    if not mine:
        return {}
    process_set, members = mine[0]
    return {kind: {size: time_collective(ranks.hvd, kind, size, process_set, members,
                                         repeats(size, quick)) for size in sizes}
            for kind in KINDS}


def summarize(groups, per_rank):
    """nccl-tests' rows of one scope from every rank's {kind: {size: seconds}}: per kind and
    size the slowest member's time, algbw and busbw (GB/s), and the latency (smallest size)."""
    n = len(groups[0])
    table = {"groups": groups, "ranks_per_group": n}
    for kind in KINDS:
        rows = []
        sizes = sorted({size for times in per_rank if times for size in times[kind]})
        for size in sizes:
            seconds = max(times[kind][size] for times in per_rank if times)
            algbw = size / seconds
            rows.append({"bytes": size, "time_us": seconds * 1e6, "algbw_gbps": algbw / 1e9,
                         "busbw_gbps": algbw * BUS_FACTORS[kind](n) / 1e9})
        table[kind] = {"rows": rows, "latency_us": rows[0]["time_us"],
                       "peak_busbw_gbps": max(r["busbw_gbps"] for r in rows)}
    return table


def measure_all(ranks, rank_hosts, max_bytes, quick):
    """{scope: table (summarize) or {"skipped": reason}} over every scope."""
    sizes = message_sizes(max_bytes)
    report = {}
    for scope, groups in scope_groups(rank_hosts, quick).items():
        if isinstance(groups, str):
            report[scope] = {"skipped": groups}
            continue
        report[scope] = summarize(groups, ranks.gather(measure_scope(ranks, groups, sizes,
                                                                     quick)))
    return report


def training_step_check(ranks, device):
    """One forward and backward of the tiny model: each rank's slice of a batch, gradients
    averaged across the ranks (Horovod), against the whole batch on this one device.
    {"loss", "max_gradient_difference", "relative_difference", "agrees"} (fp32; agrees: the
    relative difference is below 1e-4, a reduction order's rounding)."""
    import tensorflow as tf

    from tfbig.doctor import probes

    with tf.device(device):
        net, loss_of = probes.tiny_model()
        if ranks.hvd and ranks.size > 1:  # Horovod: every rank starts from rank 0's weights
            from tfbig.distribute import horovod_keras

            horovod_keras.broadcast_variables(net.variables, root_rank=0)
        per_rank = probes.TINY_SEQUENCES_PER_RANK
        batch = probes.tiny_batch(per_rank * ranks.size)
        loss, reference = probes.gradients(net, loss_of, batch)
        mine = batch[ranks.rank * per_rank:(ranks.rank + 1) * per_rank]
        _, local = probes.gradients(net, loss_of, mine)
        local = [tf.convert_to_tensor(g) for g in local]
        if ranks.hvd and ranks.size > 1:  # Horovod: the gradient average of every rank
            local = ranks.hvd.grouped_allreduce(local, op=ranks.hvd.Average)
    reference = [tf.convert_to_tensor(g) for g in reference]
    difference = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(reference, local))
    scale = max(float(tf.reduce_max(tf.abs(g))) for g in reference)
    return {"loss": float(loss), "max_gradient_difference": difference,
            "relative_difference": difference / scale, "agrees": difference / scale < 1e-4}
